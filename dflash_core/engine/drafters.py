"""The drafter replicas at work: one thread per replica, and the gradient averaging that joins
them (within this host, and across hosts once a multi-host group binds its process group).

Threads: drafter-<dev>, one per replica, started after warm-up (warmup.py says why not before).
Per step each runs its replica's micro-batches (forward + backward); the job's thread then sums
the replicas' gradients on the first replica's device, lets the rank protocol exchange the step
(ranks.py), finishes the average (the cross-host all-reduce, the mean copied back into every
replica) and has each thread run its replica's optimizer step.

Gradient averaging (`GradSync`): every replica ends holding the bit-identical mean. Within a host
the mean is computed once on the first replica's device (reduce) and copied back to the others
(broadcast), so identical inputs to identical optimizers keep replicas identical.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .config import TrainJob
from .objective import job_objective
from .optim import load_optimizer_state
from .pipeline import FeaturePipeline
from .replica import DrafterReplica, StepAccumulator

T = TypeVar("T")
# exchange(futures, local_error): the rank protocol's look at the finished micro-steps
Exchange = Callable[[list[cf.Future], BaseException | None], T]


class GradSync:
    def __init__(self, process_group=None, guard: Callable[[str, Callable[[], Any]], Any] | None = None) -> None:
        """guard(what, call): runs the cross-host all-reduce (a multi-host group turns its failure
        into the job's readable, resumable error)."""
        self.process_group = process_group
        self.guard = guard

    @torch.no_grad()
    def average(self, grads_per_replica: list[list[torch.Tensor]]) -> None:
        """grads_per_replica[r][i] is gradient i of replica r (same shapes across r)."""
        self.finish(self.local_sum(grads_per_replica), grads_per_replica)

    @torch.no_grad()
    def local_sum(self, grads_per_replica: list[list[torch.Tensor]]) -> torch.Tensor | None:
        """This host's sum of the replicas' gradients, flat and fp32 on the first replica's device
        (None where there is nothing to average). Allocates: call it before a collective that
        must not wait for a rank whose allocation failed."""
        if len(grads_per_replica) == 1 and self.process_group is None:
            return None
        flat = torch._utils._flatten_dense_tensors(grads_per_replica[0]).float()
        for other in grads_per_replica[1:]:
            flat += torch._utils._flatten_dense_tensors(other).to(flat.device, torch.float32, non_blocking=True)
        return flat

    @torch.no_grad()
    def finish(self, flat: torch.Tensor | None, grads_per_replica: list[list[torch.Tensor]]) -> None:
        """The all-reduce across hosts (with a process group), the mean, and its copy into every
        replica's gradients."""
        if flat is None:
            return
        world = 1
        if self.process_group is not None:
            import torch.distributed as dist

            def reduce() -> None:
                dist.all_reduce(flat, group=self.process_group)

            if self.guard is not None:
                self.guard("the gradient all-reduce", reduce)
            else:
                reduce()
            world = dist.get_world_size(self.process_group)
        flat /= len(grads_per_replica) * world
        for grads in grads_per_replica:
            src = flat.to(grads[0].device, non_blocking=True)
            for g, s in zip(grads, torch._utils._unflatten_dense_tensors(src, grads)):
                g.copy_(s)


class Drafters:
    """The replicas, their threads and their gradient averaging."""

    def __init__(self, grad_sync: GradSync):
        self.grad_sync = grad_sync
        self.replicas: list[DrafterReplica] = []  # set when the engine is built
        self.pools: list[cf.ThreadPoolExecutor] = []
        self.threads: list[threading.Thread] = []
        self.tokens_per_device: dict[str, int] = {}  # context tokens trained since the engine started

    # ------------------------------------------------------------------ threads
    def start(self, replicas: list[DrafterReplica], on_thread: Callable[[str], None]) -> None:
        """One thread per replica, started now (executors start them lazily)."""
        self.replicas = replicas
        for rep in replicas:
            name = f"drafter-{rep.device}"
            self.pools.append(
                cf.ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=name,
                    initializer=self._thread_started,
                    initargs=(name, rep.device, on_thread),
                )
            )
        for pool in self.pools:
            pool.submit(lambda: None).result()

    def _thread_started(self, name: str, device: torch.device, on_thread: Callable[[str], None]) -> None:
        on_thread(name)
        self.threads.append(threading.current_thread())
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def alive(self) -> bool:
        return bool(self.threads) and all(t.is_alive() for t in self.threads)

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self.pools = []

    # ------------------------------------------------------------------ a job
    def begin_job(self, job: TrainJob, gamma: float, per_step: int, recipe: str) -> None:
        """A fresh optimizer per replica, and the job's step settings (its objective, gamma, and
        whether gradients are summed in fp32: several micro-batches or ranks per step)."""
        objective = job_objective(job, recipe) if self.replicas[0].objective is not None else None
        for rep in self.replicas:
            rep.new_optimizer(job.learning_rate, job.weight_decay, job.adam_betas)
            rep.sum_grads_in_fp32 = per_step > 1 or self.grad_sync.process_group is not None
            rep.gamma = gamma
            if rep.objective is not None and objective is not None:
                rep.objective.set(objective)

    def load_optimizer(self, state: dict[str, Any]) -> None:
        for rep in self.replicas:
            assert rep.optimizer is not None
            # a copy each: on CPU load_state_dict keeps the given tensors, and replicas must not share state
            load_optimizer_state(rep.optimizer, copy.deepcopy(state))

    @contextlib.contextmanager
    def job_scope(self) -> Iterator[None]:
        """Whatever the job's end: drop what it kept (gradients, optimizer state, fp32 sums)."""
        try:
            yield
        finally:
            for rep in self.replicas:
                rep.end_job()
            if any(r.device.type == "cuda" for r in self.replicas):
                torch.cuda.empty_cache()

    # ------------------------------------------------------------------ a step
    def step(
        self, pipeline: FeaturePipeline, job: TrainJob, lr: float, exchange: Exchange[T]
    ) -> tuple[list[StepAccumulator], float, T]:
        """One optimizer step: every replica's micro-batches, this host's gradient sum, the rank
        protocol's exchange (which raises the step's failure, if any), the average, the update.
        Returns the replicas' accumulators, the gradient norm and what the exchange returned."""
        futures = [
            pool.submit(self._micro_steps, r, pipeline, job.grad_accum)
            for r, pool in zip(range(len(self.replicas)), self.pools, strict=True)
        ]
        cf.wait(futures)  # every replica done (or failed) before anything else touches the grads
        grads = [rep.grads() for rep in self.replicas]
        # this host's sum first (it allocates): a failure there is voted like a failed micro-step,
        # never left for the other ranks to find in the gradient all-reduce
        flat, local_error = None, None
        if all(f.exception() is None for f in futures):
            try:
                flat = self.grad_sync.local_sum(grads)
            except Exception as e:  # noqa: BLE001 - raised by the exchange
                local_error = e
        exchanged = exchange(futures, local_error)
        accs = [f.result() for f in futures]
        self.grad_sync.finish(flat, grads)
        norms = [
            pool.submit(rep.clip_and_step, job.grad_clip, lr)
            for rep, pool in zip(self.replicas, self.pools, strict=True)
        ]
        cf.wait(norms)
        for f in norms[1:]:
            f.result()
        return accs, float(norms[0].result()), exchanged

    def _micro_steps(self, r: int, pipeline: FeaturePipeline, accum: int) -> StepAccumulator:
        rep = self.replicas[r]
        acc = rep.new_accumulator()
        t = time.monotonic()
        try:
            for _ in range(accum):
                item = pipeline.get(r)
                try:
                    rep.forward_backward(item.batch, item.features, 1.0 / accum, acc)
                finally:
                    item.release()  # forward and backward are queued: a copy into it waits for them
                acc.context_tokens += item.context_tokens
            if rep.device.type == "cuda":
                torch.cuda.synchronize(rep.device)
        except BaseException as e:
            # stop the pipeline: the other replicas' threads, waiting for micro-batches that a
            # worker cannot deliver while this replica's queue is full, must fail too, not hang
            if pipeline.error is None:
                pipeline.error = e
            pipeline.stop.set()
            raise
        acc.extra["seconds"] = time.monotonic() - t
        return acc

    def count(self, accs: list[StepAccumulator], seconds: float) -> tuple[dict[str, int], dict[str, float]]:
        """This host's context tokens and seconds per device for one step (kept as running totals too)."""
        per_dev: dict[str, int] = {}
        secs: dict[str, float] = {}
        for rep, a in zip(self.replicas, accs, strict=True):
            dev = str(rep.device)
            per_dev[dev] = per_dev.get(dev, 0) + a.context_tokens
            secs[dev] = a.extra.get("seconds", seconds)
            self.tokens_per_device[dev] = self.tokens_per_device.get(dev, 0) + a.context_tokens
        return per_dev, secs

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        target: Any,
        tokenizer: Any,
        conversations: list[Any],
        job: TrainJob,
        tokenizer_turn: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> dict[str, Any]:
        """Acceptance length of the current drafter on held-out prompts (speculative decoding),
        in the first replica's thread (tokenizer_turn: evaluate_acceptance's)."""
        from ..evaluate import evaluate_acceptance

        rep = self.replicas[0]
        result = (
            self.pools[0]
            .submit(
                evaluate_acceptance,
                target,
                rep.drafter,
                tokenizer,
                conversations[: job.eval_max_prompts],
                max_new_tokens=job.eval_max_new_tokens,
                drafter_device=rep.device,
                head=rep.head,
                tokenizer_turn=tokenizer_turn,
            )
            .result()
        )
        summary = result.summary()
        if result.confidence:  # DSpark: calibrate the confidence head on these held-out positions
            from ..recipes.dspark import calibrate

            logits, outcomes = zip(*result.confidence, strict=True)
            summary["confidence_calibration"] = calibrate(torch.tensor(logits), torch.tensor(outcomes))
        return summary
