"""The training engine: built and warmed once, then runs jobs one at a time.

Threads after warm-up:
  target-<dev>   the feature pipeline's workers: pack micro-batches, capture target features,
                 hand them to the drafters (pipeline.py)
  drafter-<dev>  one per replica: forward + backward of its micro-batches, optimizer step
  caller         the job's thread: this loop; averages gradients across replicas, checkpoints
No worker thread exists before warm-up ends (warmup.py says why).

In a multi-host group (distributed.py) every rank runs this loop on its share of each step's
micro-batches: rank 0 takes jobs from its caller (`run_job`), the other ranks receive them from
rank 0 (`follow`); per step the ranks exchange stop votes, failures and statistics, then average
gradients; only rank 0 evaluates and writes checkpoints, after the ranks compared weight checksums.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_training_state, load_weights, read_config
from ..config import DrafterConfig
from ..confine import OutsideRoots, resolved_under
from ..data.batches import MicroBatchStream
from ..data.cache_entry import sweep_partial
from ..data.job import JobData, load_job_data
from ..data.prepare import PrepareCancelled, PrepareProgress, Tokenization, save_tokenizer
from ..devices import CudaContexts
from ..step.blocks import expected_acceptance_length
from ..target import TargetModel
from ..telemetry import RateMeter, allocator_stats
from .api import EngineStatus, JobCallbacks, JobError, JobResult, StepStats
from .checkpointing import (
    Checkpointer,
    HostSnapshot,
    checkpoint_due,
    checkpoint_size,
    expected_layout,
    human_bytes,
)
from .compile import (
    ARTIFACTS_FILE,
    CompileGuard,
    load_artifacts,
    log_compile_times,
    save_artifacts,
    trusted_artifacts,
    trusted_cache_dir,
    use_cache_dir,
)
from .config import EngineConfig, TrainJob, job_template
from .distributed import RankGroup, RankLost, empty_tensors, flatten_state, unflatten_state, weights_checksum
from .grad_sync import GradSync
from .guards import check_data_tokens, check_step, check_trained
from .kinds import run_class
from .objective import check_objective, job_objective
from .optim import load_optimizer_state, lr_factor
from .pipeline import FeaturePipeline
from .replica import DrafterReplica, StepAccumulator
from .start_clock import StartClock
from .warmup import Parts, Timeline, build, flat_devices, recipe_gamma, reset_weights, resolve_devices

log = logging.getLogger("dflash.engine")
DATA_PROGRESS_SECONDS = 2.0  # how often a job preparing its data reports progress


class PeerFailed(JobError):
    """Another rank reported a failure in a collective: this rank stops without voting again."""


class _Control:
    """The per-step control vector the ranks sum (float64, exact for the counts and the 52-bit
    checksums it carries): stop votes, failures, the step's statistics, one checksum per rank."""

    CANCEL, SHUTDOWN, FAILED, LOSS, MICRO, TOKENS = range(6)

    def __init__(self, block_size: int, world: int):
        self.block, self.world = block_size, world
        self.size = 6 + 2 * block_size + world

    def new(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64)

    def correct(self, v: torch.Tensor) -> torch.Tensor:
        return v[6 : 6 + self.block]

    def counted(self, v: torch.Tensor) -> torch.Tensor:
        return v[6 + self.block : 6 + 2 * self.block]

    def checksums(self, v: torch.Tensor) -> torch.Tensor:
        return v[6 + 2 * self.block :]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        data_dir: str | Path,
        on_phase: Callable[[EngineStatus], None] | None = None,
        group: RankGroup | None = None,
    ):
        """on_phase(status) is called from the building thread at every phase change; group: this
        process's place in a multi-host group (joined by build()), None for one process."""
        self.config = config
        self.group = group
        self.data_dir = Path(data_dir)
        # before anything imports dynamo: it fixes inductor's cache directory at import
        if config.inductor_cache_dir is not None:
            use_cache_dir(str(config.inductor_cache_dir), "engine.inductor_cache_dir")
        else:
            use_cache_dir(*trusted_cache_dir(self.data_dir / "inductor-cache", self.data_dir))
        target_devices, self.drafter_devices = resolve_devices(config)
        # created beside the imports that come next (dynamo here, transformers in build())
        self._cuda_contexts = CudaContexts(flat_devices(target_devices) + self.drafter_devices)
        self.timeline = Timeline(len(self.drafter_devices), lambda *_: on_phase and on_phase(self.status()))
        self.guard = CompileGuard()
        self.grad_sync = GradSync()
        self.rate = RateMeter()
        self.parts: Parts | None = None
        self.ready = False
        self._tokens_per_device: dict[str, int] = {}
        self._pipeline: FeaturePipeline | None = None
        self._start_clock = StartClock()  # the running job's (replaced by each job)
        self._host_snapshot: HostSnapshot | None = None  # checkpoint buffers every job reuses
        self._saved_tokenizer: tuple[Path, str] | None = None
        self._drafter_pools: list[cf.ThreadPoolExecutor] = []
        self._worker_threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ build + warm-up
    def build(self) -> Engine:
        """Load everything and warm it, in the calling thread. Returns self when ready (in a
        group: this rank is ready; rank 0's status says when every rank is)."""
        try:
            self._build()
        except BaseException as e:
            if self.group is not None and self.group.backend is not None:
                self.group.announce_failed(f"{type(e).__name__}: {e}")
            raise
        return self

    def _build(self) -> None:
        if self.group is not None:
            self.timeline.enter("joining_group")
            backend = "nccl" if any(d.startswith("cuda") for d in self.drafter_devices) else "gloo"
            self.group.join(backend)
            self.timeline.mark("build:group_joined")
        if trusted_artifacts(self.data_dir / ARTIFACTS_FILE, self.data_dir) and load_artifacts(
            self.data_dir / ARTIFACTS_FILE
        ):
            self.timeline.mark("build:compile_artifacts_loaded")
        for partial in ("tokens", "tokens/tokenizers"):  # what a killed daemon's tokenization left
            sweep_partial(self.data_dir / "cache" / partial)
        self.parts = build(self.config, self.data_dir, self.timeline, self._cuda_contexts, self.grad_sync)
        if self.group is not None:
            # only now: each rank warms on its own time (a cold cache, a slow disk), so warm-up's
            # exercise of the gradient sync stays on this host
            self.grad_sync.process_group = self.group.grad_group
            self.grad_sync.guard = self.group.guarded
        self._prepare_host_snapshot()
        self.guard.end_warmup(enforce=self.parts.plan.compiled)
        self.timeline.mark("warmup:done")
        if self.parts.plan.compiled:
            log_compile_times()
        for rep in self.replicas:
            name = f"drafter-{rep.device}"
            self._drafter_pools.append(
                cf.ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=name,
                    initializer=self._thread_started,
                    initargs=(name, rep.device),
                )
            )
        for pool in self._drafter_pools:  # start the threads now (executors start them lazily)
            pool.submit(lambda: None).result()
        self.ready = True
        if self.group is not None:
            self.group.announce_ready(self._rank_description())
        self.timeline.enter("ready", len(self.replicas))

    def _prepare_host_snapshot(self) -> None:
        """The checkpoint's pinned host buffers, allocated once per engine (every job has the same
        shapes): pinning gigabytes takes seconds and holds up the device's other calls, which a
        job would otherwise spend before its first step."""
        leader = self.group is None or self.group.is_leader
        if leader and self.replicas and self.replicas[0].device.type == "cuda":
            self._host_snapshot = HostSnapshot()
            self._host_snapshot.prepare(expected_layout(self.replicas[0]))
            self._host_snapshot.wait()
            self.timeline.mark("build:checkpoint_buffers")

    def _rank_description(self) -> dict[str, Any]:
        """What every rank of a group must share to train together (compared by rank 0)."""
        assert self.parts is not None
        from importlib import metadata

        return {
            "drafters": len(self.replicas),
            "versions": [metadata.version("dflash-trainer"), torch.__version__],
            "shape": dict(vars(self.config.shape)),
            "drafter": self.parts.drafter_config.to_dict(),
            "plan": str(self.parts.plan),
        }

    @property
    def replicas(self) -> list[DrafterReplica]:
        return self.parts.replicas if self.parts is not None else []

    @property
    def targets(self) -> list[TargetModel]:
        return self.parts.targets if self.parts is not None else []

    @property
    def drafter_config(self) -> DrafterConfig:
        assert self.parts is not None, "the engine is not built"
        return self.parts.drafter_config

    @property
    def tokenizer(self) -> Any:
        assert self.parts is not None, "the engine is not built"
        return self.parts.tokenizer

    def _thread_started(self, name: str, device: torch.device) -> None:
        self.timeline.mark(f"thread:{name}")
        self._worker_threads.append(threading.current_thread())
        if device.type == "cuda":
            torch.cuda.set_device(device)

    # ------------------------------------------------------------------ status
    def status(self) -> EngineStatus:
        tl = self.timeline
        pipeline = self._pipeline
        targets = self.parts.targets if self.parts else []
        devices = {*self.drafter_devices, *(str(d) for t in targets for d in t.stages)}
        return EngineStatus(
            phase=tl.phase,
            ready=self.ready,
            drafters_ready=tl.drafters_ready,
            drafters_total=tl.drafters_total,
            elapsed_seconds=tl.elapsed(),
            warmup=tuple(tl.warmup),
            compiles=self.guard.counts(),
            drafter_devices=tuple(self.drafter_devices),
            tokens_per_device=dict(self._tokens_per_device),
            tokens_per_second=self.rate.rate(),
            queue_depths=self._queue_depths(pipeline),
            threads_alive=bool(self._worker_threads) and all(t.is_alive() for t in self._worker_threads),
            allocator={d: s for d in sorted(devices) if (s := allocator_stats(d))} if self.ready else {},
            **self._group_status(),
        )

    def _group_status(self) -> dict[str, Any]:
        group = self.group
        if group is None:
            return {"rank": 0, "ranks_total": 1, "ranks_ready": int(self.ready), "group_problem": None}
        return {
            "rank": group.rank,
            "ranks_total": group.world,
            "ranks_ready": group.ranks_ready() if group.is_leader else int(self.ready),
            "group_problem": group.problem(),
        }

    def _queue_depths(self, pipeline: FeaturePipeline | None) -> dict[str, int]:
        """Every drafter queue, empty between jobs (a series per queue from the first reading on)."""
        live = pipeline.depths() if pipeline is not None else {}
        names = (FeaturePipeline.queue_name(r.index, r.device) for r in self.replicas)
        return {name: live.get(name, 0) for name in names}

    def build_timeline(self) -> list[tuple[str, float]]:
        """(event, seconds since the engine was created), in order: where time to ready went."""
        return self.timeline.labels()

    # ------------------------------------------------------------------ validation
    def validate_job(self, job: TrainJob) -> None:
        """Raise JobError(message, field) for a job this engine cannot run as warmed. Works before
        the engine is built (shape checks), so jobs can be queued while it warms."""
        if (run := run_class(job)) is not None:  # another kind of job (kinds.py)
            return run(self).validate(job)
        shape = self.config.shape
        for name, want in (
            ("seq_len", shape.seq_len),
            ("num_anchors", shape.num_anchors),
            ("block_size", shape.block_size),
        ):
            got = getattr(job, name)
            if got is not None and got != want:
                raise JobError(
                    f"{got} differs from the warmed engine's {name}={want}; the engine compiled for "
                    f"seq_len={shape.seq_len}, num_anchors={shape.num_anchors}, "
                    f"block_size={shape.block_size} and does not recompile at runtime",
                    name,
                )
        check_objective(job, self.config.teacher, self.config.recipe)
        if job.steps is not None and job.steps < 1:
            raise JobError("must be at least 1", "steps")
        if job.steps is None and job.epochs is None:
            raise JobError("give steps or epochs", "steps")
        if job.init_from and self.parts is not None:  # before build: checked again when the job starts
            try:
                other = read_config(job.init_from)
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise JobError(str(e), "init_from") from None
            mine = self.parts.drafter_config
            if other != mine:
                diff = [k for k, v in other.to_dict().items() if mine.to_dict()[k] != v]
                raise JobError(f"checkpoint architecture differs from the engine's drafter in {diff}", "init_from")
        if self.parts is not None:
            self._check_template(job)
            self._check_output(job)

    def _check_output(self, job: TrainJob) -> None:
        """The output directory can take a checkpoint: writable, and room for one on its file
        system (checked again before each checkpoint), so that a read-only or full disk is a
        refusal at submission rather than a failure after hours of training."""
        path = Path(job.output_dir)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is None:
            return
        if not os.access(existing, os.W_OK):
            raise JobError(
                f"{job.output_dir!r} cannot be written (read-only file system or no permission)", "output_dir"
            )
        st = os.statvfs(existing)
        free, need = st.f_bavail * st.f_frsize, checkpoint_size(self.replicas[0], job.export_dtype)
        if free < need:
            raise JobError(
                f"{job.output_dir!r}: {human_bytes(free)} free on its file system, a checkpoint needs about "
                f"{human_bytes(need)} (ENOSPC)",
                "output_dir",
            )

    def _check_template(self, job: TrainJob) -> None:
        """Render a small conversation with the job's template and options, so that a template
        that cannot render (or an option it rejects) is refused before the job is queued."""
        assert self.parts is not None
        field = "chat_template" if job.chat_template else "chat_template_kwargs"
        try:
            template = job_template(job)
        except OutsideRoots as e:
            raise JobError(str(e), "chat_template") from None
        except (OSError, UnicodeDecodeError) as e:
            raise JobError(f"cannot read the template: {e}", "chat_template") from None
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        try:
            text = template.render(self.parts.tokenizer, probe, add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - any template failure is the user's to fix
            raise JobError(f"the chat template cannot render a conversation: {type(e).__name__}: {e}", field) from None
        if "pong" not in text:
            raise JobError("the chat template does not render the assistant's message", field)

    # ------------------------------------------------------------------ running jobs
    def run_job(
        self, job: TrainJob, callbacks: JobCallbacks | None = None, resume_from: str | None = None
    ) -> JobResult:
        """Train `job` to its end, a cancel or a shutdown (callbacks.should_cancel); raises JobError.
        In a group, called on rank 0 only: the job goes to the other ranks from here."""
        if not self.ready:
            raise JobError("engine is not ready")
        if (run := run_class(job)) is not None:  # another kind of job (kinds.py)
            with self._lock:
                return run(self).execute(job, callbacks or JobCallbacks(), resume_from)
        group = self.group
        if group is not None:
            if not group.is_leader:
                raise JobError(f"rank {group.rank} runs the jobs rank 0 sends; submit jobs to rank 0")
            if (problem := group.problem()) is not None:
                raise JobError(f"the group cannot train: {problem}", resumable=group.broken is not None)
            if group.ranks_ready() < group.world:
                raise JobError(f"{group.ranks_ready()} of {group.world} ranks are ready", resumable=True)
        self.validate_job(job)
        if group is not None:
            group.post({"kind": "run", "job": job.to_dict(), "resume_from": resume_from})
        return self._guarded_run(job, callbacks or JobCallbacks(), resume_from)

    def follow(self, stop: threading.Event, callbacks: Callable[[], JobCallbacks] | None = None) -> str:
        """Ranks other than 0: run the jobs rank 0 sends until it says shutdown, `stop` is set or
        the group breaks; returns why it ended. A job's failure is reported to rank 0 by the
        collectives and logged by the caller through callbacks().on_event("job_failed", ...)."""
        group = self.group
        assert group is not None and not group.is_leader and self.ready
        while True:
            command = group.next_command(stop)
            if command is None:
                return group.broken or "stopped"
            if command.get("kind") == "shutdown":
                return "rank 0 shut the group down"
            cb = callbacks() if callbacks is not None else JobCallbacks()
            try:
                try:
                    job = TrainJob.from_dict(command["job"])
                except Exception as e:  # noqa: BLE001 - e.g. a field of a newer rank 0: the job fails readably
                    message = f"rank {group.rank} cannot read the job rank 0 sent ({type(e).__name__}: {e})"
                    group.report_error(group.command_number, message)
                    group.agree([2, 0, 0, 0], "the job's start")
                    raise JobError(message) from None
                self._guarded_run(job, cb, command.get("resume_from"))
            except JobError as e:  # rank 0 reports it with the job; here it goes to this rank's log
                log.warning("the job rank 0 sent failed here", extra={"fields": {"error": e.message}})
                cb.on_event("job_failed", {"error": e.message})
            if group.broken is not None:
                return group.broken

    def _guarded_run(self, job: TrainJob, cb: JobCallbacks, resume_from: str | None) -> JobResult:
        with self._lock:
            try:
                return self._run(job, cb, resume_from)
            except JobError:
                raise
            except torch.OutOfMemoryError as e:
                raise JobError(f"out of memory: {str(e).splitlines()[0]}") from e
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobError(f"{type(e).__name__}: {e}") from e
            finally:
                for rep in self.replicas:
                    rep.end_job()
                if any(r.device.type == "cuda" for r in self.replicas):
                    torch.cuda.empty_cache()

    def _run(self, job: TrainJob, cb: JobCallbacks, resume_from: str | None) -> JobResult:
        assert self.parts is not None
        group = self.group
        leader = group is None or group.is_leader
        ranks = group.world if group is not None else 1
        per_step = len(self.replicas) * job.grad_accum * ranks
        control = _Control(self.drafter_config.block_size, ranks)
        self._start_clock = clock = StartClock()
        prepared = self._prepare(job, cb, resume_from, per_step, control)
        if prepared is None:
            return JobResult("STOPPED", 0, 0, resume_from)
        data, stream, total, start = prepared
        step = start
        warmup_steps = int(job.warmup_ratio * total)
        checkpointer: Checkpointer | None = None
        wants_eval = leader and bool(data.heldout) and bool(job.eval_interval or job.eval_fraction or job.eval_prompts)
        stats: StepStats | None = None
        eval_result: dict[str, Any] | None = None
        status = "SUCCEEDED"
        trained = 0  # labelled block positions this run trained on
        peer_left: str | None = None
        last: str | None = None
        self.rate.reset()
        pipeline: FeaturePipeline | None = None
        try:  # from here on, a failure releases the checkpointer's directory and buffers
            if leader:  # in the try: a failure to open the output directory is voted like any other
                checkpointer = Checkpointer(
                    job,
                    self.replicas[0],
                    cb,
                    total_steps=total,
                    micro_batches_per_step=per_step,
                    replicas=len(self.replicas) * ranks,
                    target_path=self.parts.target_path,
                    resumed_from=resume_from,
                    snapshot=self._host_snapshot,
                )
            clock.mark("checkpointer")
            pipeline = FeaturePipeline(
                self.parts.targets,
                [r.device for r in self.replicas],
                stream,
                first=start * per_step,
                end=total * per_step,
                grad_accum=job.grad_accum,
                feature_spec=self.parts.feature_spec,
                on_thread=lambda n: self.timeline.mark(f"thread:{n}"),
                share=(group.rank, ranks) if group is not None else (0, 1),
            )
            self._pipeline = pipeline.start()
            clock.mark("pipeline_start")
            while step < total:
                cancel = cb.should_cancel()
                if group is None and cancel:
                    status = "STOPPED"
                    break
                lr = job.learning_rate * lr_factor(step, total, warmup_steps, job.min_lr_ratio)
                stats, votes = self._train_step(
                    pipeline, job, step + 1, total, lr, stream.per_epoch, per_step, control, cancel
                )
                step += 1
                if not clock.reported:
                    clock.mark("first_step")
                    clock.report(cb.on_event)
                check_step(stats)  # before the step is recorded or checkpointed
                trained += stats.labels
                cb.on_step(stats)
                if step == total:  # before the last checkpoint: a job that trained on nothing writes none
                    check_trained(step - start, trained)
                stopping = votes is not None and bool(votes[_Control.CANCEL] or votes[_Control.SHUTDOWN])
                if group is not None and (stopping or checkpoint_due(job, step, total)):
                    self._compare_weights(control, step)
                if wants_eval and ((job.eval_interval and step % job.eval_interval == 0) or step == total):
                    eval_result = self.evaluate(data.heldout, job)
                    cb.on_eval(step, eval_result)
                if checkpointer is not None:
                    checkpointer.save(step, stats, eval_result)
                if stopping:
                    assert votes is not None
                    status = "STOPPED"
                    if votes[_Control.SHUTDOWN] and not votes[_Control.CANCEL]:
                        peer_left = "a rank is shutting down"
                    break
            if checkpointer is not None:
                last = checkpointer.finish(
                    step, stats, eval_result, stopped_early=status == "STOPPED", first_step=start
                )
            if group is not None:  # every rank past the end (rank 0: the last checkpoint written)
                self._all_sum(control, control.new(), "the job's end")
        except BaseException as e:
            if checkpointer is not None:
                checkpointer.abandon()
            self._vote_failure(control, e)
            if group is not None and group.broken is not None and not isinstance(e, RankLost):
                # e.g. the thread that saw the failed collective was not this one: still the group's loss
                raise RankLost(
                    f"{group.broken}; the job continues from its last checkpoint when every rank is started again"
                ) from e
            raise
        finally:
            self._pipeline = None
            if pipeline is not None:
                pipeline.close()
        if peer_left is not None:
            assert group is not None
            group.mark_broken(f"{peer_left} (it left the group)")
            raise JobError(
                f"stopped at step {step}: {peer_left}; the job continues from the checkpoint of step {step} "
                "when every rank is started again",
                resumable=True,
            )
        return JobResult(status, step, total, last, stats, eval_result, data.skipped_lines)

    def _prepare(
        self, job: TrainJob, cb: JobCallbacks, resume_from: str | None, per_step: int, control: _Control
    ) -> tuple[JobData, MicroBatchStream, int, int] | None:
        """The job's data, micro-batch stream, step count and first step, with the replicas holding
        the first step's state; None when the job was stopped while preparing. In a group every
        rank prepares its own copy of the data, then the ranks agree that all of them succeeded and
        see the same data before rank 0's start state is sent to the others."""
        group = self.group
        failure: BaseException | None = None
        stopped = False
        prepared: tuple[JobData, MicroBatchStream, int, int] | None = None
        optimizer_state: tuple[Any, list[torch.Tensor]] = (None, [])
        try:
            try:
                data = self._load_data(job, cb)
            except OutsideRoots as e:
                raise JobError(str(e), "datasets") from None
            self._start_clock.mark("data_open")
            stream = MicroBatchStream(
                data.corpus,
                self.config.shape,
                self.parts.pad_token_id if self.parts else 0,
                seed=job.seed,
                exclude=data.exclude,
            )
            total = job.steps or max(1, math.ceil((job.epochs or 0) * stream.per_epoch / per_step))
            check_data_tokens(int(data.corpus.lengths.sum()))
            self._start_clock.mark("batch_plan")
            cb.on_event(
                "data",
                {
                    "documents": len(data.corpus) - len(data.exclude),
                    "tokens": int(data.corpus.lengths.sum()),
                    "micro_batches_per_epoch": stream.per_epoch,
                    "truncated_documents": data.corpus.truncated_documents,
                    "dropped_documents": stream.report.dropped_documents,
                    "heldout": len(data.exclude) or len(data.heldout),
                    "total_steps": total,
                },
            )
            leader = group is None or group.is_leader
            start = self._start_state(job, cb, resume_from if leader else None, per_step, read_files=leader)
            self._start_clock.mark("start_state")
            if group is not None and group.is_leader:
                assert self.replicas[0].optimizer is not None
                optimizer_state = flatten_state(self.replicas[0].optimizer.state_dict())
            prepared = (data, stream, total, start)
        except PrepareCancelled:
            stopped = True
        except BaseException as e:
            if group is None:
                raise
            failure = e
            group.report_error(
                group.command_number, e.message if isinstance(e, JobError) else f"{type(e).__name__}: {e}"
            )
        if group is None:
            return prepared
        # 1: rank 0 stopped (a cancel, or its shutdown); 3: another rank shuts down
        outcome = 2 if failure is not None else (1 if group.is_leader else 3) if stopped else 0
        mine = (
            [outcome, 0, 0, 0]
            if prepared is None
            else [outcome, prepared[1].per_epoch, int(prepared[0].corpus.lengths.sum()), prepared[2]]
        )
        if outcome != 0 and group.is_leader:
            group.signal_stop()  # the others need not finish preparing a job that will not run

        def leader_cancels() -> None:  # rank 0 waiting for a slower rank still takes a cancel
            if group.is_leader and cb.should_cancel():
                group.signal_stop()

        views = group.agree(mine, "the job's start", on_wait=leader_cancels)
        failed = [r for r, v in enumerate(views) if v[0] == 2]
        if failed:
            if failure is not None:
                raise failure
            errors = group.errors_of(group.command_number)
            raise PeerFailed("; ".join(f"rank {r}: {errors.get(r, 'failed to prepare the job')}" for r in failed))
        leaving = [r for r, v in enumerate(views) if v[0] == 3]
        if leaving:
            group.mark_broken(f"rank(s) {', '.join(map(str, leaving))} shut down (they left the group)")
            raise JobError(
                f"rank(s) {', '.join(map(str, leaving))} shut down while the job prepared its data; it starts "
                "when every rank is started again",
                resumable=True,
            )
        if any(v[0] == 1 for v in views):
            return None
        assert prepared is not None
        differ = [r for r, v in enumerate(views) if v[1:] != views[0][1:]]
        if differ:
            raise JobError(
                f"rank(s) {', '.join(map(str, differ))} read different data than rank 0 (micro-batches per epoch, "
                f"tokens, steps: {[views[0][1:]] + [views[r][1:] for r in differ]}): every host needs the same "
                "dataset files at the same paths",
                "datasets",
            )
        return (*prepared[:3], self._share_start_state(prepared[3], optimizer_state, control))

    def _share_start_state(self, start: int, optimizer_state: tuple[Any, list[torch.Tensor]], control: _Control) -> int:
        """Rank 0's weights, optimizer state (flattened by rank 0 before the ranks agreed to start)
        and first step on every rank (a resume or init_from is read by rank 0 only: the other hosts
        need not see its output directory); then one control all-reduce in which a rank that could
        not load them says so."""
        group = self.group
        assert group is not None
        first = self.replicas[0]
        skeleton, tensors = optimizer_state
        meta = group.broadcast_json({"start": start, "optimizer": skeleton}, "sending the start state")
        with torch.no_grad():
            group.broadcast_tensors([m for _, m in first.named_masters()], first.device, "sending the start weights")
        error: BaseException | None = None
        if not group.is_leader:
            try:
                tensors = empty_tensors(meta["optimizer"], first.device)
            except Exception as e:  # noqa: BLE001 - this host is out of memory: the broadcast below goes
                # without this rank, so the others see it only at the collective timeout (then a lost rank)
                error, tensors = e, []
        if error is None:
            group.broadcast_tensors(tensors, first.device, "sending the optimizer state")
        if not group.is_leader and error is None:
            try:
                first.load_state(first.weights_state())  # refreshes the bf16 working copies from the masters
                state = unflatten_state(meta["optimizer"], tensors)
                weights = first.weights_state()
                for rep in self.replicas:
                    if rep is not first:
                        rep.load_state(weights)
                    assert rep.optimizer is not None
                    load_optimizer_state(rep.optimizer, state if rep is first else copy.deepcopy(state))
            except Exception as e:  # noqa: BLE001 - voted below
                error = e
        vote = control.new()
        if error is not None:
            group.report_error(group.command_number, f"loading rank 0's start state: {type(error).__name__}: {error}")
            vote[_Control.FAILED] = 1
        self._all_sum(control, vote, "loading the start state")
        if error is not None:
            error._voted = True  # type: ignore[attr-defined]
            raise error
        return int(meta["start"])

    def _all_sum(self, control: _Control, vector: torch.Tensor, what: str) -> torch.Tensor:
        """One control all-reduce; raises PeerFailed when a rank voted a failure in it."""
        group = self.group
        assert group is not None
        out = group.all_sum(vector, what)
        if out[_Control.FAILED] > 0 and not vector[_Control.FAILED]:
            errors = group.errors_of(group.command_number)
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items())) or "a rank failed"
            raise PeerFailed(text)
        return out

    def _vote_failure(self, control: _Control, error: BaseException) -> None:
        """A rank that fails between collectives sends the failure in the collective the others
        wait in (every collective after the start is a control all-reduce of the same size)."""
        group = self.group
        if group is None or group.broken is not None or isinstance(error, (PeerFailed, RankLost)):
            return
        if getattr(error, "_voted", False):
            return
        message = error.message if isinstance(error, JobError) else f"{type(error).__name__}: {error}"
        group.report_error(group.command_number, message)
        vote = control.new()
        vote[_Control.FAILED] = 1
        with contextlib.suppress(RankLost):  # the group is gone: nobody waits for the vote
            group.all_sum(vote, "reporting a failure")

    def _compare_weights(self, control: _Control, step: int) -> None:
        """Every rank's replicas hold the same weights (checked before rank 0 checkpoints them)."""
        group = self.group
        assert group is not None
        vector = control.new()
        checksum = weights_checksum(m for _, m in self.replicas[0].named_masters()) % (1 << 52)
        control.checksums(vector)[group.rank] = checksum
        sums = control.checksums(self._all_sum(control, vector, "comparing weights")).tolist()
        differ = [r for r, c in enumerate(sums) if c != sums[0]]
        if differ:
            raise JobError(
                f"step {step}: the weights of rank(s) {', '.join(map(str, differ))} differ from rank 0's (checksums "
                f"{[int(c) for c in sums]}); the replicas diverged, so no checkpoint was written"
            )

    def _load_data(self, job: TrainJob, cb: JobCallbacks) -> JobData:
        """Tokenize what the cache lacks (reported as the job's preparing_data phase) and open it."""
        reported = [0.0]
        group = self.group

        def progress(p: PrepareProgress) -> None:
            now = time.monotonic()
            done = p.files_done == p.files_total
            if done or now - reported[0] >= DATA_PROGRESS_SECONDS:
                reported[0] = now
                cb.on_data_progress(
                    {
                        "files_total": p.files_total,
                        "files_done": p.files_done,
                        "files_cached": p.files_cached,
                        "bytes_total": p.bytes_total,
                        "bytes_done": p.bytes_done,
                        "fraction": round(p.fraction, 4),
                        "documents": p.documents,
                        "tokens": p.tokens,
                        "seconds": round(p.seconds, 3),
                        "done": done,
                        **({"rebuilt_cache_entries": p.rebuilt} if p.rebuilt else {}),
                    }
                )

        data = load_job_data(
            job.datasets,
            self._tokenization(job),
            self.data_dir / "cache" / "tokens",
            skip_bad_lines=job.skip_bad_lines,
            eval_prompts=job.eval_prompts,
            eval_fraction=job.eval_fraction,
            eval_max_prompts=job.eval_max_prompts,
            seed=job.seed,
            progress=progress,
            should_stop=lambda: cb.should_cancel() or (group is not None and group.stop_signalled()),
            roots=job.dataset_roots,
        )
        if data.skipped_lines:
            cb.on_event("skipped_lines", {"count": data.skipped_lines, "first": data.skip_messages})
        return data

    def _tokenization(self, job: TrainJob) -> Tokenization:
        """What the job's tokenized cache entries depend on: the engine's tokenizer (saved once
        per engine, with the mask token it may have added), the chat template and the length."""
        assert self.parts is not None
        if self._saved_tokenizer is None:
            self._saved_tokenizer = save_tokenizer(self.parts.tokenizer, self.data_dir / "cache" / "tokens")
        directory, digest = self._saved_tokenizer
        return Tokenization(str(directory), digest, job_template(job), self.config.seq_len)

    def _start_state(
        self, job: TrainJob, cb: JobCallbacks, resume_from: str | None, per_step: int, read_files: bool = True
    ) -> int:
        """Weights, optimizer, RNG and loss weights for the job's first step; the step it starts at.
        read_files=False (ranks other than 0): fresh weights and optimizer, overwritten by rank 0's."""
        assert self.parts is not None
        source = (resume_from or job.init_from) if read_files else None  # a resume starts from its checkpoint
        if source and job.init_from and not resume_from:
            try:
                source = str(resolved_under(job.init_from, job.dataset_roots + job.output_roots, "init_from"))
            except OutsideRoots as e:
                raise JobError(str(e), "init_from") from None
        layers = self.parts.drafter_config.num_hidden_layers
        weights = load_weights(source, layers, masters=True) if source else None
        reset_weights(self.replicas, job.seed, weights)
        gamma = (
            job.loss_gamma
            if job.loss_gamma is not None
            else recipe_gamma(self.config.recipe, job.block_size or self.config.block_size)
        )
        for rep in self.replicas:
            rep.new_optimizer(job.learning_rate, job.weight_decay, job.adam_betas)
            rep.sum_grads_in_fp32 = per_step > 1 or self.grad_sync.process_group is not None
            rep.gamma = gamma
            if rep.objective is not None:
                rep.objective.set(job_objective(job, self.config.recipe))
        if not resume_from:
            return 0
        state = load_training_state(resume_from)
        if state is None:
            raise JobError(f"{resume_from}: no training state to resume from")
        for rep in self.replicas:
            assert rep.optimizer is not None
            # a copy each: on CPU load_state_dict keeps the given tensors, and replicas must not share state
            load_optimizer_state(rep.optimizer, copy.deepcopy(state["optimizer"]))
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        cb.on_event("resumed", {"from": str(resume_from), "step": int(state["step"])})
        saved = int(state.get("replicas", len(self.replicas))) * int(state.get("grad_accum", job.grad_accum))
        if saved != per_step:
            cb.on_event(
                "resume_data_order_changed",
                {
                    "message": f"the checkpoint was written with {saved} micro-batches per step, this engine runs "
                    f"{per_step}: training continues, but not on the data order of the first run"
                },
            )
        return int(state["step"])

    def _train_step(
        self,
        pipeline: FeaturePipeline,
        job: TrainJob,
        step: int,
        total: int,
        lr: float,
        per_epoch: int,
        per_step: int,
        control: _Control,
        cancel: bool,
    ) -> tuple[StepStats, torch.Tensor | None]:
        """One optimizer step: every replica's micro-batches, the gradient average, the update.
        In a group, also the ranks' summed control vector (their votes and statistics)."""
        t = time.monotonic()
        pools = self._drafter_pools
        futures = [
            pool.submit(self._micro_steps, r, rep, pipeline, job.grad_accum)
            for r, (rep, pool) in enumerate(zip(self.replicas, pools, strict=True))
        ]
        cf.wait(futures)  # every replica done (or failed) before anything else touches the grads
        votes = None
        grads = [rep.grads() for rep in self.replicas]
        if self.group is not None:
            # this host's sum first (it allocates): a failure there is voted like a failed micro-step,
            # never left for the others to find in the gradient all-reduce
            flat, local_error = None, None
            if all(f.exception() is None for f in futures):
                try:
                    flat = self.grad_sync.local_sum(grads)
                except Exception as e:  # noqa: BLE001 - voted in the exchange
                    local_error = e
            votes = self._exchange_step(control, futures, cancel, local_error)
            accs = [f.result() for f in futures]
            self.grad_sync.finish(flat, grads)
        else:
            accs = [f.result() for f in futures]
            self.grad_sync.average(grads)
        norms = [
            pool.submit(rep.clip_and_step, job.grad_clip, lr) for rep, pool in zip(self.replicas, pools, strict=True)
        ]
        cf.wait(norms)
        norm = float(norms[0].result())
        for f in norms[1:]:
            f.result()
        stats = self._step_stats(accs, step, total, time.monotonic() - t, lr, norm, per_epoch, per_step, control, votes)
        return stats, votes

    def _exchange_step(
        self, control: _Control, futures: list[cf.Future], cancel: bool, local_error: BaseException | None = None
    ) -> torch.Tensor:
        """This rank's vote (stop, failure) and statistics summed with every rank's; raises this
        rank's own failure (after telling the others) or PeerFailed."""
        group = self.group
        assert group is not None
        vector = control.new()
        vector[_Control.CANCEL if group.is_leader else _Control.SHUTDOWN] = float(cancel)
        error = next((e for f in futures if (e := f.exception()) is not None), local_error)
        if error is not None:
            message = error.message if isinstance(error, JobError) else f"{type(error).__name__}: {error}"
            group.report_error(group.command_number, message)
            vector[_Control.FAILED] = 1
        else:
            for f in futures:
                acc = f.result()
                vector[_Control.LOSS] += float(acc.loss_sum)
                vector[_Control.MICRO] += acc.micro_batches
                vector[_Control.TOKENS] += acc.context_tokens
                control.correct(vector).add_(acc.correct.cpu().double())
                control.counted(vector).add_(acc.counted.cpu().double())
        votes = self._all_sum(control, vector, "the step's control all-reduce")
        if error is not None:
            error._voted = True  # type: ignore[attr-defined]  # _vote_failure must not vote twice
            raise error
        return votes

    def _micro_steps(self, r: int, rep: DrafterReplica, pipeline: FeaturePipeline, accum: int) -> StepAccumulator:
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

    def _step_stats(
        self,
        accs: list[StepAccumulator],
        step: int,
        total: int,
        seconds: float,
        lr: float,
        norm: float,
        per_epoch: int,
        per_step: int,
        control: _Control,
        votes: torch.Tensor | None,
    ) -> StepStats:
        """The step's statistics: over every rank in a group (from the summed control vector),
        except the per-device tokens and times, which are this rank's own."""
        if votes is None:
            loss = sum(float(a.loss_sum) for a in accs) / sum(a.micro_batches for a in accs)
            correct = sum(a.correct.cpu() for a in accs)  # [B] over all replicas
            counted = sum(a.counted.cpu() for a in accs)
            tokens = sum(a.context_tokens for a in accs)
        else:
            loss = float(votes[_Control.LOSS] / votes[_Control.MICRO])
            correct, counted = control.correct(votes).float(), control.counted(votes).float()
            tokens = int(votes[_Control.TOKENS])
        assert isinstance(correct, torch.Tensor) and isinstance(counted, torch.Tensor)
        acc_per_pos = (correct[1:] / counted[1:].clamp_min(1)).tolist()
        per_dev: dict[str, int] = {}
        secs: dict[str, float] = {}
        for rep, a in zip(self.replicas, accs, strict=True):
            dev = str(rep.device)
            per_dev[dev] = per_dev.get(dev, 0) + a.context_tokens
            secs[dev] = a.extra.get("seconds", seconds)
            self._tokens_per_device[dev] = self._tokens_per_device.get(dev, 0) + a.context_tokens
        # rank 0 reports the job's rate; the other ranks their own devices'
        leader = self.group is None or self.group.is_leader
        self.rate.add(tokens if leader else sum(per_dev.values()), seconds)
        return StepStats(
            step,
            total,
            loss,
            acc_per_pos,
            expected_acceptance_length([1.0, *acc_per_pos]),
            tokens,
            per_dev,
            seconds,
            secs,
            self.rate.rate(),
            lr,
            norm,
            step * per_step / per_epoch,
            int(counted[1:].sum().item()),
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, conversations: list[Any], job: TrainJob) -> dict[str, Any]:
        """Acceptance length of the current drafter on held-out prompts (speculative decoding)."""
        from ..evaluate import evaluate_acceptance

        assert self.parts is not None
        rep = self.replicas[0]
        fut = self._drafter_pools[0].submit(
            evaluate_acceptance,
            self.parts.targets[0],
            rep.drafter,
            self.parts.tokenizer,
            conversations[: job.eval_max_prompts],
            max_new_tokens=job.eval_max_new_tokens,
            drafter_device=rep.device,
            head=rep.head,
        )
        result = fut.result()
        summary = result.summary()
        if result.confidence:  # DSpark: calibrate the confidence head on these held-out positions
            from ..recipes.dspark import calibrate

            logits, outcomes = zip(*result.confidence, strict=True)
            summary["confidence_calibration"] = calibrate(torch.tensor(logits), torch.tensor(outcomes))
        return summary

    def save_compile_artifacts(self) -> int:
        """Write what warm-up compiled as portable artifacts to <data_dir>/compile-artifacts.bin,
        which a later build loads first; their size (0: nothing to save)."""
        return save_artifacts(self.data_dir / ARTIFACTS_FILE)

    def close(self) -> None:
        for pool in self._drafter_pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self._drafter_pools = []
        self.ready = False
        if self._host_snapshot is not None:  # gigabytes of pinned host memory
            self._host_snapshot.clear()
            self._host_snapshot = None
        self.guard.release()
