"""The training engine: built and warmed once, then runs jobs one at a time.

Threads after warm-up:
  target-<dev>   the feature pipeline's workers: pack micro-batches, capture target features,
                 hand them to the drafters (pipeline.py)
  drafter-<dev>  one per replica: forward + backward of its micro-batches, optimizer step
  caller         the job's thread: this loop; averages gradients across replicas, checkpoints
No worker thread exists before warm-up ends (warmup.py says why).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_training_state, load_weights, read_config
from ..config import DrafterConfig, LossConfig
from ..confine import OutsideRoots, resolved_under
from ..data.batches import MicroBatchStream
from ..data.job import JobData, load_job_data
from ..data.prepare import PrepareCancelled, PrepareProgress, Tokenization, save_tokenizer
from ..devices import CudaContexts
from ..step.blocks import expected_acceptance_length
from ..target import TargetModel
from ..telemetry import RateMeter, allocator_stats
from .api import EngineStatus, JobCallbacks, JobError, JobResult, StepStats
from .checkpointing import Checkpointer, checkpoint_size
from .compile import ARTIFACTS_FILE, CompileGuard, load_artifacts, log_compile_times, save_artifacts, use_cache_dir
from .config import EngineConfig, TrainJob, job_template
from .grad_sync import GradSync
from .optim import load_optimizer_state, lr_factor
from .pipeline import FeaturePipeline
from .replica import DrafterReplica, StepAccumulator
from .warmup import Parts, Timeline, build, flat_devices, reset_weights, resolve_devices

DATA_PROGRESS_SECONDS = 2.0  # how often a job preparing its data reports progress


class Engine:
    def __init__(
        self, config: EngineConfig, data_dir: str | Path, on_phase: Callable[[EngineStatus], None] | None = None
    ):
        """on_phase(status) is called from the building thread at every phase change."""
        self.config = config
        self.data_dir = Path(data_dir)
        # before anything imports dynamo: it fixes inductor's cache directory at import
        if config.inductor_cache_dir is not None:
            use_cache_dir(str(config.inductor_cache_dir), "engine.inductor_cache_dir")
        else:
            use_cache_dir(str(self.data_dir / "inductor-cache"), "the data directory's default")
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
        self._saved_tokenizer: tuple[Path, str] | None = None
        self._drafter_pools: list[cf.ThreadPoolExecutor] = []
        self._worker_threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ build + warm-up
    def build(self) -> Engine:
        """Load everything and warm it, in the calling thread. Returns self when ready."""
        if load_artifacts(self.data_dir / ARTIFACTS_FILE):
            self.timeline.mark("build:compile_artifacts_loaded")
        self.parts = build(self.config, self.data_dir, self.timeline, self._cuda_contexts, self.grad_sync)
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
        self.timeline.enter("ready", len(self.replicas))
        return self

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
        )

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
                f"{job.output_dir!r}: {free / 2**30:.2f} GiB free on its file system, a checkpoint needs about "
                f"{need / 2**30:.2f} GiB (ENOSPC)",
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
        """Train `job` to its end, a cancel or a shutdown (callbacks.should_cancel); raises JobError."""
        if not self.ready:
            raise JobError("engine is not ready")
        self.validate_job(job)
        with self._lock:
            try:
                return self._run(job, callbacks or JobCallbacks(), resume_from)
            except JobError:
                raise
            except torch.OutOfMemoryError as e:
                raise JobError(f"out of memory: {str(e).splitlines()[0]}") from e
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobError(f"{type(e).__name__}: {e}") from e
            finally:
                for rep in self.replicas:
                    rep.zero_grad()
                    rep.optimizer = None
                    rep.sum_grads_in_fp32 = False
                    rep.write_guard = None
                if any(r.device.type == "cuda" for r in self.replicas):
                    torch.cuda.empty_cache()

    def _run(self, job: TrainJob, cb: JobCallbacks, resume_from: str | None) -> JobResult:
        assert self.parts is not None
        try:
            data = self._load_data(job, cb)
        except PrepareCancelled:
            return JobResult("STOPPED", 0, 0, resume_from)
        except OutsideRoots as e:
            raise JobError(str(e), "datasets") from None
        stream = MicroBatchStream(
            data.corpus, self.config.shape, self.parts.pad_token_id, seed=job.seed, exclude=data.exclude
        )
        per_step = len(self.replicas) * job.grad_accum
        total = job.steps or max(1, math.ceil((job.epochs or 0) * stream.per_epoch / per_step))
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
        start = step = self._start_state(job, cb, resume_from, per_step)
        warmup_steps = int(job.warmup_ratio * total)
        checkpointer = Checkpointer(
            job,
            self.replicas[0],
            cb,
            total_steps=total,
            micro_batches_per_step=per_step,
            replicas=len(self.replicas),
            target_path=self.parts.target_path,
            resumed_from=resume_from,
        )
        wants_eval = bool(data.heldout) and bool(job.eval_interval or job.eval_fraction or job.eval_prompts)
        stats: StepStats | None = None
        eval_result: dict[str, Any] | None = None
        status = "SUCCEEDED"
        self.rate.reset()
        pipeline: FeaturePipeline | None = None
        try:  # from here on, a failure releases the checkpointer's directory and buffers
            pipeline = FeaturePipeline(
                self.parts.targets,
                [r.device for r in self.replicas],
                stream,
                first=start * per_step,
                end=total * per_step,
                grad_accum=job.grad_accum,
                feature_spec=self.parts.feature_spec,
                on_thread=lambda n: self.timeline.mark(f"thread:{n}"),
            )
            self._pipeline = pipeline.start()
            while step < total:
                if cb.should_cancel():
                    status = "STOPPED"
                    break
                lr = job.learning_rate * lr_factor(step, total, warmup_steps, job.min_lr_ratio)
                stats = self._train_step(pipeline, job, step + 1, total, lr, stream.per_epoch, per_step)
                step += 1
                cb.on_step(stats)
                if wants_eval and ((job.eval_interval and step % job.eval_interval == 0) or step == total):
                    eval_result = self.evaluate(data.heldout, job)
                    cb.on_eval(step, eval_result)
                checkpointer.save(step, stats, eval_result)
            last = checkpointer.finish(step, stats, eval_result, stopped_early=status == "STOPPED", first_step=start)
        except BaseException:
            checkpointer.abandon()
            raise
        finally:
            self._pipeline = None
            if pipeline is not None:
                pipeline.close()
        return JobResult(status, step, total, last, stats, eval_result, data.skipped_lines)

    def _load_data(self, job: TrainJob, cb: JobCallbacks) -> JobData:
        """Tokenize what the cache lacks (reported as the job's preparing_data phase) and open it."""
        reported = [0.0]

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
            should_stop=cb.should_cancel,
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

    def _start_state(self, job: TrainJob, cb: JobCallbacks, resume_from: str | None, per_step: int) -> int:
        """Weights, optimizer, RNG and loss weights for the job's first step; the step it starts at."""
        assert self.parts is not None
        source = resume_from or job.init_from  # a resume starts from its checkpoint's weights
        if job.init_from and not resume_from:
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
            else LossConfig().resolved_gamma(job.block_size or self.config.block_size)
        )
        for rep in self.replicas:
            rep.new_optimizer(job.learning_rate, job.weight_decay, job.adam_betas)
            rep.sum_grads_in_fp32 = per_step > 1 or self.grad_sync.process_group is not None
            rep.gamma = gamma
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
        self, pipeline: FeaturePipeline, job: TrainJob, step: int, total: int, lr: float, per_epoch: int, per_step: int
    ) -> StepStats:
        """One optimizer step: every replica's micro-batches, the gradient average, the update."""
        t = time.monotonic()
        pools = self._drafter_pools
        futures = [
            pool.submit(self._micro_steps, r, rep, pipeline, job.grad_accum)
            for r, (rep, pool) in enumerate(zip(self.replicas, pools, strict=True))
        ]
        cf.wait(futures)  # every replica done (or failed) before anything else touches the grads
        accs = [f.result() for f in futures]
        self.grad_sync.average([rep.grads() for rep in self.replicas])
        norms = [
            pool.submit(rep.clip_and_step, job.grad_clip, lr) for rep, pool in zip(self.replicas, pools, strict=True)
        ]
        cf.wait(norms)
        norm = float(norms[0].result())
        for f in norms[1:]:
            f.result()
        return self._step_stats(accs, step, total, time.monotonic() - t, lr, norm, per_epoch, per_step)

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
    ) -> StepStats:
        loss = sum(float(a.loss_sum) for a in accs) / sum(a.micro_batches for a in accs)
        correct = sum(a.correct.cpu() for a in accs)  # [B] over all replicas
        counted = sum(a.counted.cpu() for a in accs)
        assert isinstance(correct, torch.Tensor) and isinstance(counted, torch.Tensor)
        acc_per_pos = (correct[1:] / counted[1:].clamp_min(1)).tolist()
        tokens = sum(a.context_tokens for a in accs)
        per_dev: dict[str, int] = {}
        secs: dict[str, float] = {}
        for rep, a in zip(self.replicas, accs, strict=True):
            dev = str(rep.device)
            per_dev[dev] = per_dev.get(dev, 0) + a.context_tokens
            secs[dev] = a.extra.get("seconds", seconds)
            self._tokens_per_device[dev] = self._tokens_per_device.get(dev, 0) + a.context_tokens
        self.rate.add(tokens, seconds)
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
        return fut.result().summary()

    def save_compile_artifacts(self) -> int:
        """Write what warm-up compiled as portable artifacts to <data_dir>/compile-artifacts.bin,
        which a later build loads first; their size (0: nothing to save)."""
        return save_artifacts(self.data_dir / ARTIFACTS_FILE)

    def close(self) -> None:
        for pool in self._drafter_pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self._drafter_pools = []
        self.ready = False
        self.guard.release()
