"""The training engine: builds the target and the drafter replicas, warms every drafter device
one at a time in the calling thread, then runs jobs on per-device worker threads.

Threads after warmup:
  target-<dev>   produces micro-batches: packs, captures target features, hands them to the
                 drafters through bounded queues (one queue per drafter replica)
  drafter-<dev>  one per replica: forward + backward of its micro-batches, optimizer step
  caller         (the job's thread) averages gradients across replicas, writes checkpoints
No worker thread exists before warmup ends (the multi-thread first-compile deadlock, DESIGN §2).
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import math
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..step.attention import FLEX_TILE, usable_q_splits
from ..step.blocks import expected_acceptance_length
from ..checkpoint import cpu_copy, load_training_state, load_weights, read_config, write_checkpoint
from ..config import DrafterConfig
from ..data.batches import MicroBatch, MicroBatchStream, synthetic_micro_batch
from ..devices import CudaContexts, compute_dtype
from ..target import TargetModel
from ..telemetry import RateMeter, allocator_stats
from .checkpoint_writer import CheckpointWriter
from .compile_guard import CompileGuard
from .compile_workers import compile_delta, compile_snapshot, compile_workers_ready, start_compile_workers
from .config import EngineConfig, TrainJob
from .feature_slots import FeatureSlots
from .grad_sync import GradSync
from ..data.job import load_job_data
from .optim import load_optimizer_state, lr_factor
from .replica import DrafterReplica

log = logging.getLogger("dflash.engine")


@dataclass
class Progress:
    phase: str
    drafters_ready: int
    drafters_total: int
    elapsed: float


@dataclass
class StepStats:
    step: int  # steps completed (1-based)
    total_steps: int
    loss: float
    position_accuracy: list[float]  # block positions 1..B-1
    expected_acceptance_length: float
    context_tokens: int
    tokens_per_device: dict[str, int]
    step_seconds: float
    seconds_per_device: dict[str, float]
    tokens_per_second: float
    learning_rate: float
    grad_norm: float
    epoch: float


class JobCallbacks:
    """Hooks a job runner calls; override what you need."""

    def on_step(self, stats: StepStats) -> None: ...
    def on_checkpoint(self, path: str, step: int) -> None: ...
    def on_checkpoints_removed(self, paths: list[str]) -> None: ...
    def on_event(self, kind: str, payload: dict) -> None: ...
    def on_eval(self, step: int, result: dict) -> None: ...
    def should_cancel(self) -> bool:
        return False


@dataclass
class JobResult:
    status: str  # SUCCEEDED | STOPPED
    steps_done: int
    total_steps: int
    final_checkpoint: str | None
    last_stats: StepStats | None = None
    eval: dict | None = None
    skipped_lines: int = 0


class JobValidationError(ValueError):
    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


class JobFailed(RuntimeError):
    """A job could not finish; the message is meant for the user."""


class _Pipeline:
    """Per-job hand-off state shared by the target workers and the drafter threads."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None


def _queue_name(rep: DrafterReplica) -> str:
    return f"drafter-{rep.index}-{rep.device}"


class Engine:
    def __init__(self, config: EngineConfig, data_dir: str | Path, progress: Callable[[Progress], None] | None = None):
        self.config = config
        self.data_dir = Path(data_dir)
        self._progress_cb = progress or (lambda p: None)
        self._t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []  # ordering record (warmup vs thread starts)
        # created beside the imports that come next (dynamo here, transformers in build())
        self._cuda_contexts = CudaContexts(config.target_devices + config.drafter_devices)
        self.guard = CompileGuard()
        self.grad_sync = GradSync()
        self.rate = RateMeter()
        self.tokens_per_device: dict[str, int] = {}
        self.queue_depths: dict[str, int] = {}
        self.warmup_seconds: list[tuple[str, str, float]] = []  # (component, device, seconds)
        self.ready = False
        self.targets: list[TargetModel] = []
        self.replicas: list[DrafterReplica] = []
        self._drafter_pools: list[cf.ThreadPoolExecutor] = []
        self._worker_threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.progress = Progress("starting", 0, len(config.drafter_devices), 0.0)

    # ------------------------------------------------------------------ build + warmup
    def _report(self, phase: str, ready: int) -> None:
        self.progress = Progress(phase, ready, len(self.config.drafter_devices), time.monotonic() - self._t0)
        self._mark(f"progress:{phase}:{ready}")
        self._progress_cb(self.progress)

    def _mark(self, label: str) -> None:
        self.events.append((time.monotonic(), label))

    def build_timeline(self) -> list[tuple[str, float]]:
        """(event, seconds since the engine was created), in order: where time to ready went."""
        return [(label, round(t - self._t0, 3)) for t, label in self.events]

    def _delay(self) -> None:
        if self.config.warmup_delay_seconds > 0:
            time.sleep(self.config.warmup_delay_seconds)

    def build(self) -> "Engine":
        """Load everything and warm it, in the calling thread. Returns self when ready."""
        cfg = self.config
        if cfg.inductor_cache_dir:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cfg.inductor_cache_dir)
            if os.environ["TORCHINDUCTOR_CACHE_DIR"] != cfg.inductor_cache_dir:
                # the cold/warm start depends on it: say which one wins
                log.info("inductor cache: %s (TORCHINDUCTOR_CACHE_DIR overrides inductor_cache_dir %s)",
                         os.environ["TORCHINDUCTOR_CACHE_DIR"], cfg.inductor_cache_dir)
        attention, compiled = cfg.resolved_attention(), cfg.resolved_compile()
        if cfg.compile_workers not in ("early", "lazy"):
            raise ValueError(f"compile_workers must be 'early' or 'lazy', not {cfg.compile_workers!r}")
        # ready by the first drafter compile, not during it
        compile_workers = (compiled and cfg.compile_workers == "early"
                           and any(torch.device(d).type == "cuda" for d in cfg.drafter_devices)
                           and start_compile_workers())
        if compile_workers:
            self._mark("build:compile_workers_started")
        self._report("loading_target", 0)
        self._delay()
        target_path = cfg.target_path
        if target_path is None:
            from ..defaults import ensure_default_assets

            target_path = str(ensure_default_assets(self.data_dir).target)
        self.target_path = target_path
        from transformers import AutoConfig, AutoTokenizer

        self._mark("build:transformers_imported")
        self.tokenizer = AutoTokenizer.from_pretrained(target_path)
        hf_cfg = AutoConfig.from_pretrained(target_path)
        self._mark("build:tokenizer_and_config")
        mask_id = self._mask_token_id(hf_cfg)
        self.drafter_config = DrafterConfig.from_target_config(
            hf_cfg, num_hidden_layers=cfg.drafter_layers, block_size=cfg.shape.block_size, mask_token_id=mask_id,
            target_layer_ids=cfg.target_layer_ids, intermediate_size=cfg.drafter_intermediate_size,
        )
        if self.tokenizer.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id or 0
        else:
            self.pad_token_id = self.tokenizer.pad_token_id
        self._cuda_contexts.wait()
        self._mark("build:cuda_contexts")
        for dev in cfg.target_devices:
            t = time.monotonic()
            self.targets.append(TargetModel(target_path, self.drafter_config.target_layer_ids, dev,
                                            random_init=cfg.target_random_init, seed=cfg.init_seed))
            self.warmup_seconds.append(("target_load", dev, time.monotonic() - t))
            self._mark(f"build:target_loaded:{dev}")

        self._report("warming_target", 0)
        self._delay()
        warm_batch = self._synthetic_batch()
        warm_features = None
        for target in self.targets:
            t = time.monotonic()
            feats = self._capture(target, warm_batch)
            self._sync(target.device)
            if warm_features is None:  # reused by the drafters
                warm_features = feats
                self._feature_spec = (tuple(feats.shape), feats.dtype)  # every micro-batch's (static shapes)
            self.warmup_seconds.append(("target", str(target.device), time.monotonic() - t))
            self._mark(f"build:target_warm:{target.device}")

        head = self.targets[0].frozen_head()
        if compiled:
            self._raise_recompile_limit(len(cfg.drafter_devices))
        gamma = cfg.loss.resolved_gamma(cfg.shape.block_size)
        for i, dev in enumerate(cfg.drafter_devices):
            self.replicas.append(DrafterReplica(
                i, self.drafter_config, dev, head, attention=attention, compiled=compiled,
                compute_dtype=compute_dtype(dev), gamma=gamma, chunk_size=cfg.loss.chunk_size,
                compile_scope=cfg.compile_scope, flex_q_splits=cfg.flex_q_splits,
                loss_kernel=cfg.resolved_loss_kernel(), working_weights=cfg.resolved_working_weights(),
            ))
            self._mark(f"build:replica_created:{dev}")
        if attention == "flex":
            splits = usable_q_splits(cfg.shape.num_query_tokens, cfg.flex_q_splits)
            if splits != cfg.flex_q_splits:
                log.warning("flex_q_splits %d reduced to %d: %d block tokens do not split into whole %d-query tiles",
                            cfg.flex_q_splits, splits, cfg.shape.num_query_tokens, FLEX_TILE)
        self._reset_weights(seed=cfg.init_seed, init_from=None)
        self._mark("build:weights_initialized")

        self._report("warming_drafters", 0)
        self._delay()
        self._mark("warmup:drafters:start")
        if compile_workers:
            self._mark(f"warmup:compile_workers_ready={compile_workers_ready()}")
        for i, rep in enumerate(self.replicas):
            t = time.monotonic()
            before = compile_snapshot() if compiled else {}
            self._warm_replica(rep, warm_batch, warm_features)
            self.warmup_seconds.append(("drafter", str(rep.device), time.monotonic() - t))
            if compiled:  # where this GPU's compile seconds went (cold: built kernels; warm: cache loads)
                log.info("drafter warm-up compiles", extra={"fields": {
                    "device": str(rep.device), "seconds": round(time.monotonic() - t, 3),
                    **compile_delta(before, compile_snapshot())}})
            self._mark(f"warmup:drafter:{rep.device}")
            self._report("warming_drafters", i + 1)
            if i + 1 < len(self.replicas):
                self._delay()
        self.grad_sync.average([rep.grads() for rep in self.replicas])  # exercise the sync path once
        for rep in self.replicas:
            rep.zero_grad()
        self._reset_weights(seed=cfg.init_seed, init_from=None)
        self.guard.end_warmup(enforce=compiled)
        self._mark("warmup:done")
        if compiled:
            _log_compile_times()

        for rep in self.replicas:
            name = f"drafter-{rep.device}"
            self._drafter_pools.append(cf.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=name, initializer=self._thread_started, initargs=(name,)))
        for pool in self._drafter_pools:  # start the threads now (executors start them lazily)
            pool.submit(lambda: None).result()
        self.ready = True
        self._report("ready", len(self.replicas))
        return self

    @staticmethod
    def _raise_recompile_limit(devices: int) -> None:
        """Each drafter device is its own compiled entry (guards include the device index), and
        compile_scope "step" adds a few per device; past dynamo's limit (8) it would silently run
        eager. Set here, in the thread that compiles (dynamo config is per thread from 2.12)."""
        import torch._dynamo.config as dynamo_config

        need = 8 * max(1, devices)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < need:
                setattr(dynamo_config, name, need)

    def _thread_started(self, name: str) -> None:
        self._mark(f"thread:{name}")
        self._worker_threads.append(threading.current_thread())
        for rep in self.replicas:
            if rep.device.type == "cuda" and name.endswith(str(rep.device)):
                torch.cuda.set_device(rep.device)

    def _mask_token_id(self, hf_cfg) -> int:
        tok = self.tokenizer
        name = self.config.mask_token
        if name is None and tok.mask_token_id is not None:
            return int(tok.mask_token_id)
        name = name or "<|mask|>"
        ids = tok.convert_tokens_to_ids([name])
        if ids and ids[0] is not None and ids[0] != tok.unk_token_id:
            return int(ids[0])
        tok.add_special_tokens({"mask_token": name})
        mid = int(tok.mask_token_id)
        if mid >= hf_cfg.vocab_size:
            raise ValueError(f"mask token {name!r} got id {mid}, outside the target vocabulary ({hf_cfg.vocab_size})")
        return mid

    def _synthetic_batch(self) -> MicroBatch:
        return synthetic_micro_batch(self.config.shape, self.drafter_config.vocab_size, self.pad_token_id)

    def _capture(self, target: TargetModel, mb: MicroBatch) -> torch.Tensor:
        dev = target.device
        return target.capture(mb.input_ids.to(dev), mb.position_ids.to(dev), mb.doc_ids.to(dev))

    @staticmethod
    def _sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _warm_replica(self, rep: DrafterReplica, mb: MicroBatch, features: torch.Tensor) -> None:
        """One full training step at the production shape, in this thread; weights restored after.
        With bf16 working weights a second step sums its gradient in fp32 on the masters (what
        gradient accumulation and several replicas do): the AdamW kernel's variant for fp32
        gradients beside a working copy is built here too, not in a drafter thread mid-job."""
        feats = features.to(rep.device)
        batch = mb.to(rep.device)
        rep.new_optimizer(1e-4, 0.0, (0.9, 0.95))
        for fp32_sum in ((False, True) if rep.working_weights == "bf16" else (False,)):
            rep.sum_grads_in_fp32 = fp32_sum
            acc = rep.new_accumulator()
            rep.forward_backward(batch, feats, 1.0, acc)
            rep.clip_and_step(1.0, 1e-4)
            float(acc.loss_sum)  # completes the step on the device
        rep.sum_grads_in_fp32 = False
        rep.optimizer = None
        self._sync(rep.device)

    def _reset_weights(self, seed: int, init_from: str | None) -> None:
        """Every replica gets the same starting weights: a checkpoint's, or one draw on the
        first replica's device copied to the others."""
        first = self.replicas[0]
        if init_from:
            state = load_weights(init_from, self.drafter_config.num_hidden_layers)
            first.load_state(state)
        else:
            first.init_weights(seed)
        state = first.weights_state()
        for rep in self.replicas:
            if rep is not first:
                rep.load_state(state)
            rep.zero_grad()

    # ------------------------------------------------------------------ validation
    def validate_job(self, job: TrainJob) -> None:
        """Raise JobValidationError(field, message) for a job this engine cannot run as warmed.
        Works before the engine is built (shape checks), so jobs can be queued while warming."""
        shape = self.config.shape
        for name, want in (("seq_len", shape.seq_len), ("num_anchors", shape.num_anchors), ("block_size", shape.block_size)):
            got = getattr(job, name)
            if got is not None and got != want:
                raise JobValidationError(name, f"{got} differs from the warmed engine's {name}={want}; the engine "
                                               f"compiled for seq_len={shape.seq_len}, num_anchors={shape.num_anchors}, "
                                               f"block_size={shape.block_size} and does not recompile at runtime")
        if job.steps is not None and job.steps < 1:
            raise JobValidationError("steps", "must be at least 1")
        if job.init_from and hasattr(self, "drafter_config"):  # before build: checked again at run time
            try:
                other = read_config(job.init_from)
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise JobValidationError("init_from", str(e)) from None
            if other != self.drafter_config:
                diff = [k for k, v in other.to_dict().items() if self.drafter_config.to_dict()[k] != v]
                raise JobValidationError("init_from", f"checkpoint architecture differs from the engine's drafter in {diff}")
        if job.steps is None and job.epochs is None:
            raise JobValidationError("steps", "give steps or epochs")

    # ------------------------------------------------------------------ running jobs
    def run_job(self, job: TrainJob, callbacks: JobCallbacks | None = None, resume_from: str | None = None) -> JobResult:
        if not self.ready:
            raise JobFailed("engine is not ready")
        cb = callbacks or JobCallbacks()
        self.validate_job(job)
        with self._lock:
            try:
                return self._run(job, cb, resume_from)
            except (JobFailed, JobValidationError):
                raise
            except torch.OutOfMemoryError as e:
                raise JobFailed(f"out of memory: {str(e).splitlines()[0]}") from e
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobFailed(f"{type(e).__name__}: {e}") from e
            finally:
                for rep in self.replicas:
                    rep.zero_grad()
                    rep.optimizer = None
                    rep.sum_grads_in_fp32 = False
                if any(r.device.type == "cuda" for r in self.replicas):
                    torch.cuda.empty_cache()

    def _run(self, job: TrainJob, cb: JobCallbacks, resume_from: str | None) -> JobResult:
        shape = self.config.shape
        data = load_job_data(job.datasets, self.tokenizer, skip_bad_lines=job.skip_bad_lines,
                             eval_prompts=job.eval_prompts, eval_fraction=job.eval_fraction, seed=job.seed)
        if data.skipped_lines:
            cb.on_event("skipped_lines", {"count": data.skipped_lines, "first": data.skip_messages})
        stream = MicroBatchStream(data.train, shape, self.pad_token_id, seed=job.seed)
        replicas = len(self.replicas)
        per_step = replicas * job.grad_accum
        total = job.steps if job.steps is not None else max(1, math.ceil(job.epochs * stream.per_epoch / per_step))
        cb.on_event("data", {"documents": len(data.train), "micro_batches_per_epoch": stream.per_epoch,
                             "truncated_documents": stream.report.truncated_documents,
                             "heldout": len(data.heldout), "total_steps": total})

        start_step = 0
        self._reset_weights(job.seed, resume_from or job.init_from)  # a resume starts from its checkpoint's weights
        for rep in self.replicas:
            rep.new_optimizer(job.learning_rate, job.weight_decay, job.adam_betas)
            rep.sum_grads_in_fp32 = per_step > 1 or self.grad_sync.process_group is not None
        if resume_from:
            state = load_training_state(resume_from)
            if state is None:
                raise JobFailed(f"{resume_from}: no training state to resume from")
            for rep in self.replicas:
                # a copy each: on CPU load_state_dict keeps the given tensors, and replicas must not share state
                load_optimizer_state(rep.optimizer, copy.deepcopy(state["optimizer"]))
            if "torch_rng" in state:
                torch.set_rng_state(state["torch_rng"])
            start_step = int(state["step"])
            cb.on_event("resumed", {"from": str(resume_from), "step": start_step})
            saved = int(state.get("replicas", replicas)) * int(state.get("grad_accum", job.grad_accum))
            if saved != per_step:
                cb.on_event("resume_data_order_changed", {
                    "message": f"the checkpoint was written with {saved} micro-batches per step, this engine runs "
                               f"{per_step}: training continues, but not on the data order of the first run"})

        warmup_steps = int(job.warmup_ratio * total)
        gamma = job.loss_gamma if job.loss_gamma is not None else self.config.loss.resolved_gamma(shape.block_size)
        for rep in self.replicas:
            rep.gamma = gamma
        queues = [queue.Queue(maxsize=self.config.queue_depth) for _ in self.replicas]
        # one slot per queued micro-batch, one in the drafter's hands, one being filled
        slots = [FeatureSlots(*self._feature_spec, rep.device, self.config.queue_depth + 2) for rep in self.replicas]
        pipe = _Pipeline()
        producers = [
            threading.Thread(
                target=self._produce, name=f"target-{w}-{target.device}", daemon=True,
                args=(w, stream, start_step * per_step, total * per_step, job.grad_accum, queues, slots, pipe),
            )
            for w, target in enumerate(self.targets[: len(self.replicas)])
        ]
        for producer in producers:
            self._mark(f"thread:{producer.name}")
            producer.start()
        last_ckpt: str | None = str(resume_from) if resume_from else None
        last_stats: StepStats | None = None
        eval_result: dict | None = None
        status = "SUCCEEDED"
        step = start_step
        self.rate.reset()
        writer = CheckpointWriter()

        def reported(done: list[tuple[str, int]]) -> str | None:
            """Report finished checkpoints (in the loop's thread), then rotate old ones away: never
            before the newer one is recorded (a resume picks the newest recorded one on disk)."""
            for path, at_step in done:
                cb.on_checkpoint(path, at_step)
            if not done:
                return last_ckpt
            removed = _rotate_checkpoints(Path(done[-1][0]).parent, max(1, job.keep_checkpoints))
            if removed:
                cb.on_checkpoints_removed(removed)
            return done[-1][0]

        try:
            while step < total:
                if cb.should_cancel():
                    status = "STOPPED"
                    break
                t_step = time.monotonic()
                futures = [pool.submit(self._replica_micro_steps, rep, queues[i], slots[i], job.grad_accum, pipe)
                           for i, (rep, pool) in enumerate(zip(self.replicas, self._drafter_pools))]
                cf.wait(futures)  # every replica done (or failed) before anything else touches the grads
                accs = [f.result() for f in futures]
                self.grad_sync.average([rep.grads() for rep in self.replicas])
                lr = job.learning_rate * lr_factor(step, total, warmup_steps, job.min_lr_ratio)
                norms = [pool.submit(rep.clip_and_step, job.grad_clip, lr) for rep, pool in zip(self.replicas, self._drafter_pools)]
                cf.wait(norms)
                norm = float(norms[0].result())
                for f in norms[1:]:
                    f.result()
                step += 1
                last_stats = self._step_stats(accs, step, total, time.monotonic() - t_step, lr, norm, stream.per_epoch, per_step)
                cb.on_step(last_stats)
                last_ckpt = reported(writer.poll())
                if job.eval_interval and data.heldout and step % job.eval_interval == 0 and step < total:
                    eval_result = self.evaluate(data.heldout, job)
                    cb.on_eval(step, eval_result)
                if step % job.checkpoint_interval == 0 or step == total:
                    if step == total and data.heldout and (job.eval_interval or job.eval_fraction or job.eval_prompts):
                        eval_result = self.evaluate(data.heldout, job)
                        cb.on_eval(step, eval_result)
                    last_ckpt = reported(writer.wait())  # the previous write first: one snapshot in memory
                    writer.submit(self._snapshot(job, step, total, per_step, last_stats, eval_result), step)
            last_ckpt = reported(writer.wait())
            if status == "STOPPED" and step > start_step and (last_ckpt is None or not last_ckpt.endswith(f"{step:08d}")):
                writer.submit(self._snapshot(job, step, total, per_step, last_stats, eval_result), step)
                last_ckpt = reported(writer.wait())
        finally:
            pipe.stop.set()
            for q in queues:
                while True:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        break
            for producer in producers:
                producer.join(timeout=60)
            for job_slots in slots:  # a failed job's traceback keeps this frame: not its buffers
                job_slots.buffers.clear()
            for name in self.queue_depths:
                self.queue_depths[name] = 0
            try:  # after a failure: let a write in flight finish (its directory is complete or absent)
                writer.wait()
            except Exception:  # noqa: BLE001 - the failure already propagating is the job's error
                log.exception("checkpoint write failed while the job was failing")
        return JobResult(status, step, total, last_ckpt, last_stats, eval_result, data.skipped_lines)

    def _produce(self, worker: int, stream: MicroBatchStream, first: int, end: int, accum: int, queues,
                 slots: list[FeatureSlots], pipe: "_Pipeline") -> None:
        """Target worker `worker`: captures features for the drafter replicas r with r mod W == worker
        (W target workers); micro-batch g goes to replica (g mod R*accum) // accum. Each replica is
        fed by one worker, in order, so results do not depend on the number of target devices."""
        target = self.targets[worker]
        workers = min(len(self.targets), len(queues))
        per_step = len(queues) * accum
        try:
            if target.device.type == "cuda":
                torch.cuda.set_device(target.device)
            for g in range(first, end):
                r = (g % per_step) // accum
                if r % workers != worker:
                    continue
                if pipe.stop.is_set():
                    return
                rep = self.replicas[r]
                mb = stream.get(g)
                if target.device.type == "cuda":
                    mb = mb.pin_memory()
                slot = slots[r].fill(self._capture(target, mb), pipe.stop)
                if slot is None:
                    return
                item = (mb.to(rep.device, non_blocking=True), slot, mb.context_tokens)
                while not pipe.stop.is_set():
                    try:
                        queues[r].put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                self.queue_depths[_queue_name(rep)] = queues[r].qsize()
        except BaseException as e:  # noqa: BLE001 - the drafter threads raise it and fail the job
            pipe.error = e
            pipe.stop.set()

    def _replica_micro_steps(self, rep: DrafterReplica, q: queue.Queue, slots: FeatureSlots, accum: int,
                             pipe: "_Pipeline"):
        acc = rep.new_accumulator()
        t = time.monotonic()
        for _ in range(accum):
            while True:
                try:
                    item = q.get(timeout=0.2)
                    break
                except queue.Empty:
                    if pipe.error is not None:
                        err = pipe.error
                        raise JobFailed(f"target worker failed: {type(err).__name__}: {err}") from err
                    if pipe.stop.is_set():
                        raise JobFailed("the job's pipeline stopped")
            self.queue_depths[_queue_name(rep)] = q.qsize()
            batch, slot, tokens = item
            rep.forward_backward(batch, slots.buffers[slot], 1.0 / accum, acc)
            slots.release(slot)  # forward and backward are queued: a copy into it waits for them
            acc.context_tokens += tokens
        self._sync(rep.device)
        acc.extra["seconds"] = time.monotonic() - t
        return acc

    def _step_stats(self, accs, step, total, seconds, lr, norm, per_epoch, per_step) -> StepStats:
        loss = sum(float(a.loss_sum) for a in accs) / sum(a.micro_batches for a in accs)
        correct = sum(a.correct.cpu() for a in accs)  # [B] over all replicas
        counted = sum(a.counted.cpu() for a in accs)
        acc_per_pos = (correct[1:] / counted[1:].clamp_min(1)).tolist()
        tokens = sum(a.context_tokens for a in accs)
        per_dev = {}
        secs = {}
        for rep, a in zip(self.replicas, accs):
            per_dev[str(rep.device)] = per_dev.get(str(rep.device), 0) + a.context_tokens
            secs[str(rep.device)] = a.extra.get("seconds", seconds)
            self.tokens_per_device[str(rep.device)] = self.tokens_per_device.get(str(rep.device), 0) + a.context_tokens
        self.rate.add(tokens)
        return StepStats(step, total, loss, acc_per_pos, expected_acceptance_length([1.0] + acc_per_pos), tokens, per_dev,
                         seconds, secs, self.rate.rate(), lr, norm, step * per_step / per_epoch)

    def _snapshot(self, job: TrainJob, step: int, total: int, per_step: int, stats: StepStats | None,
                  eval_result) -> Callable[[], str]:
        """CPU copy of the weights and training state now (between steps: consistent), and the
        write of it as a checkpoint, for the checkpoint writer's thread."""
        out = job.output_path() / "checkpoints"
        rep = self.replicas[0]
        weights = cpu_copy(rep.weights_state())  # the fp32 masters, not the bf16 working copies
        state = cpu_copy({
            "step": step, "total_steps": total, "micro_batch_index": step * per_step,
            "optimizer": rep.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
            "replicas": len(self.replicas), "grad_accum": job.grad_accum,
        })
        meta = {"step": step, "total_steps": total, "loss": stats.loss if stats else None,
                "expected_acceptance_length": stats.expected_acceptance_length if stats else None,
                "eval_acceptance_length": (eval_result or {}).get("acceptance_length"),
                "target": str(self.target_path), "time": time.time()}
        config = rep.drafter.config

        def write() -> str:
            path = out / f"step-{step:08d}"
            try:
                return str(write_checkpoint(path, config, weights, training_state=state, metadata=meta))
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobFailed(f"checkpoint {path} could not be written: {type(e).__name__}: {e}") from e

        return write

    # ------------------------------------------------------------------ evaluation + telemetry
    def evaluate(self, conversations, job: TrainJob) -> dict:
        from ..evaluate import evaluate_acceptance

        rep = self.replicas[0]
        fut = self._drafter_pools[0].submit(
            evaluate_acceptance, self.targets[0], rep.drafter, self.tokenizer, conversations[: job.eval_max_prompts],
            max_new_tokens=job.eval_max_new_tokens, drafter_device=rep.device, head=rep.head,
        )
        return fut.result().summary()

    def allocator_stats(self) -> dict[str, dict[str, int]]:
        devices = {str(t.device) for t in self.targets} | {str(r.device) for r in self.replicas}
        return {d: s for d in sorted(devices) if (s := allocator_stats(d))}

    def compile_counts(self) -> dict[str, int]:
        return self.guard.counts()

    def threads_alive(self) -> bool:
        """Liveness (for /livez): every drafter thread started after warmup is still running."""
        return bool(self._worker_threads) and all(t.is_alive() for t in self._worker_threads)

    def close(self) -> None:
        for pool in self._drafter_pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self._drafter_pools = []
        self.ready = False
        self.guard.release()


def _rotate_checkpoints(directory: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` step-* checkpoints of a job; the deleted paths."""
    old = sorted(p for p in directory.iterdir() if p.name.startswith("step-"))[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in old]


def _log_compile_times() -> None:
    """Where a cold start's minutes went, per compiled function and phase (dynamo's own
    accounting; a private helper, so a torch without it only loses this log line)."""
    try:
        from torch._dynamo.utils import compile_times

        log.info("compile times (dynamo, seconds per function and phase):\n%s", compile_times(repr="str", aggregate=True))
    except Exception as e:  # noqa: BLE001 - diagnostics only
        log.debug("no compile times: %s", e)
