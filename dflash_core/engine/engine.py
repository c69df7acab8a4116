"""The training engine: built and warmed once, then runs jobs one at a time.

Threads after warm-up:
  target-<dev>   the feature pipeline's workers: pack micro-batches, capture target features,
                 hand them to the drafters (pipeline.py)
  drafter-<dev>  one per replica: forward + backward of its micro-batches, optimizer step (drafters.py)
  caller         the job's thread: the job's loop (dflash_core/train/run.py), gradient averaging, checkpoints
  checkpoint-buffers  once, from ready on: pins the checkpoint snapshot's host buffers (HostSnapshot)
No worker thread exists before warm-up ends (warmup.py says why).

A job is run by its kind's run class (the table of dflash_core/kinds.py; the protocol in kinds.py),
which sees the engine as the job's RunContext (context.py).
In a multi-host group every rank runs the same job on its share of each step's micro-batches:
rank 0 takes jobs from its caller (`run_job`), the other ranks receive them from rank 0
(`follow`); what the ranks say to each other is the rank protocol's (ranks.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..data.cache_entry import sweep_partial
from ..data.prepare import Tokenization, save_tokenizer
from ..data_home import CACHE_DIR, INDUCTOR_CACHE_DIR
from ..devices import CudaContexts
from ..telemetry import RateMeter, allocator_stats
from .api import EngineStatus, JobCallbacks, JobError, JobResult
from .compile import (
    ARTIFACTS_FILE,
    CompileGuard,
    load_artifacts,
    log_compile_times,
    save_artifacts,
    stable_graph_cache_keys,
    trusted_artifacts,
    trusted_cache_dir,
    use_cache_dir,
)
from .config import EngineConfig, TrainJob, job_template
from .context import LivePipeline, RunContext
from .distributed import RankGroup
from .drafters import Drafters, GradSync
from .host_snapshot import HostSnapshot, expected_layout
from .kinds import JobRun, run_class
from .pipeline import FeaturePipeline
from .ranks import GroupRanks, PeerFailed, ranks_for
from .warmup import Parts, PartsView, Timeline, build, flat_devices, resolve_devices

__all__ = ["Engine", "PeerFailed"]
log = logging.getLogger("dflash.engine")


class Engine(PartsView):
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
        self.ranks = ranks_for(group)
        self.data_dir = Path(data_dir)
        # before anything imports dynamo: it fixes inductor's cache directory at import
        if config.inductor_cache_dir is not None:
            use_cache_dir(str(config.inductor_cache_dir), "engine.inductor_cache_dir")
        else:
            use_cache_dir(*trusted_cache_dir(self.data_dir / INDUCTOR_CACHE_DIR, self.data_dir))
        stable_graph_cache_keys()
        target_devices, self.drafter_devices = resolve_devices(config)
        # created beside the imports that come next (dynamo here, transformers in build())
        self._cuda_contexts = CudaContexts(flat_devices(target_devices) + self.drafter_devices)
        self.timeline = Timeline(len(self.drafter_devices), lambda *_: on_phase and on_phase(self.status()))
        self.guard = CompileGuard()
        self.drafters = Drafters(GradSync())
        self.rate = RateMeter()
        self.parts: Parts | None = None
        self.ready = False
        self.live = LivePipeline()  # the running job's feature pipeline (status reads its queues)
        self._saved_tokenizer: tuple[Path, str] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ build + warm-up
    def build(self, checkpoints: bool = True) -> Engine:
        """Load everything and warm it, in the calling thread. Returns self when ready (in a
        group: this rank is ready; rank 0's status says when every rank is). checkpoints: pin
        the checkpoint snapshot's host buffers from ready on (False: an engine that trains no
        job, such as `precompile`'s)."""
        try:
            self._build(checkpoints)
        except BaseException as e:
            self.ranks.announce_failed(e)
            raise
        return self

    def _build(self, checkpoints: bool) -> None:
        self.ranks.join(self.drafter_devices, self.timeline)
        if trusted_artifacts(self.data_dir / ARTIFACTS_FILE, self.data_dir) and load_artifacts(
            self.data_dir / ARTIFACTS_FILE
        ):
            self.timeline.mark("build:compile_artifacts_loaded")
        for partial in ("tokens", "tokens/tokenizers"):  # what a killed daemon's tokenization left
            sweep_partial(self.data_dir / CACHE_DIR / partial)
        self.parts = build(self.config, self.data_dir, self.timeline, self._cuda_contexts)
        self.ranks.bind(self.drafters, self.parts.drafter_config.block_size)
        self.guard.end_warmup(enforce=self.parts.plan.compiled)
        self.timeline.mark("warmup:done")
        if self.parts.plan.compiled:
            log_compile_times()
        self.drafters.start(self.parts.replicas, lambda name: self.timeline.mark(f"thread:{name}"))
        self.ready = True
        self.ranks.announce_ready(lambda: self.parts.description(self.config.shape) if self.parts else {})
        self.timeline.enter("ready", len(self.replicas))
        # only rank 0 checkpoints; a CPU state needs no pinned buffers (HostSnapshot says why now)
        if checkpoints and self.ranks.leads and self.parts.replicas[0].device.type == "cuda":
            self.parts.snapshot = self._prepare_snapshot(expected_layout(self.parts.replicas[0]))

    def _prepare_snapshot(self, layout: list[tuple[torch.Size, torch.dtype, torch.device]]) -> HostSnapshot:
        """The checkpoint's pinned buffers, in the background; logged and marked when allocated (a
        checkpoint before then waits for them)."""
        snapshot = HostSnapshot()
        began = time.monotonic()
        nbytes = sum(shape.numel() * dtype.itemsize for shape, dtype, _ in layout)

        def done() -> None:
            self.timeline.mark("ready:checkpoint_buffers")
            seconds = round(time.monotonic() - began, 2)
            fields = {
                "bytes": nbytes,
                "pinned_bytes": snapshot.pinned_bytes,
                "tensors": len(layout),
                "seconds": seconds,
            }
            log.info("checkpoint buffers pinned", extra={"fields": fields})

        snapshot.prepare(layout, done)
        return snapshot

    # ------------------------------------------------------------------ status
    def status(self) -> EngineStatus:
        tl = self.timeline
        devices = {*self.drafter_devices, *(str(d) for t in self.targets for d in t.stages)}
        return EngineStatus(
            phase=tl.phase,
            ready=self.ready,
            drafters_ready=tl.drafters_ready,
            drafters_total=tl.drafters_total,
            elapsed_seconds=tl.elapsed(),
            warmup=tuple(tl.warmup),
            compiles=self.guard.counts(),
            drafter_devices=tuple(self.drafter_devices),
            tokens_per_device=dict(self.drafters.tokens_per_device),
            tokens_per_second=self.rate.rate(),
            queue_depths=self._queue_depths(),
            threads_alive=self.drafters.alive(),
            checkpoint_buffers=self.parts.snapshot.state if self.parts and self.parts.snapshot else "none",
            allocator={d: s for d in sorted(devices) if (s := allocator_stats(d))} if self.ready else {},
            **self.ranks.status(self.ready),
        )

    def _queue_depths(self) -> dict[str, int]:
        """Every drafter queue, empty between jobs (a series per queue from the first reading on)."""
        live = self.live.depths()
        names = (FeaturePipeline.queue_name(r.index, r.device) for r in self.replicas)
        return {name: live.get(name, 0) for name in names}

    def build_timeline(self) -> list[tuple[str, float]]:
        """(event, seconds since the engine was created), in order: where time to ready went."""
        return self.timeline.labels()

    # ------------------------------------------------------------------ jobs
    def validate_job(self, job: TrainJob) -> None:
        """Raise JobError(message, field) for a job this engine cannot run as warmed (its kind's
        admission). Works before the engine is built (shape checks), so jobs can be queued while
        it warms."""
        context = self.context()
        run_class(job, multi_host=context.multi_host).validate(context, job)

    def run_job(
        self, job: TrainJob, callbacks: JobCallbacks | None = None, resume_from: str | None = None
    ) -> JobResult:
        """Run `job` to its end, a cancel or a shutdown (callbacks.should_cancel); raises JobError.
        In a group, called on rank 0 only: the job goes to the other ranks from here."""
        if not self.ready:
            raise JobError("engine is not ready")
        context = self.context()
        run = run_class(job, multi_host=context.multi_host)(context, job, callbacks or JobCallbacks(), resume_from)
        run.admit()
        return self._execute(run)

    def follow(self, stop: threading.Event, callbacks: Callable[[], JobCallbacks] | None = None) -> str:
        """Ranks other than 0: run the jobs rank 0 sends until it says shutdown, `stop` is set or
        the group breaks; returns why it ended. A job's failure is reported to rank 0 by the
        collectives and logged by the caller through callbacks().on_event("job_failed", ...)."""
        ranks = self.ranks
        assert isinstance(ranks, GroupRanks) and not ranks.leads and self.ready
        while isinstance(command := ranks.next_command(stop), dict):
            cb = callbacks() if callbacks is not None else JobCallbacks()
            try:
                job = ranks.read_job(command)
                # any kind the table marks multi-host; run_class refuses the others by name
                run = run_class(job, multi_host=True)(self.context(), job, cb, command.get("resume_from"))
                self._execute(run)
            except JobError as e:  # rank 0 reports it with the job; here it goes to this rank's log
                log.warning("the job rank 0 sent failed here", extra={"fields": {"error": e.message}})
                cb.on_event("job_failed", {"error": e.message})
            if ranks.group.broken is not None:
                return ranks.group.broken
        return command

    def context(self) -> RunContext:
        """What a run of a job sees of the engine, as it is now (built or not)."""
        return RunContext(
            config=self.config,
            data_dir=self.data_dir,
            parts=self.parts,
            ranks=self.ranks,
            drafters=self.drafters,
            timeline=self.timeline,
            rate=self.rate,
            tokenization=self.tokenization,
            live=self.live,
            multi_host=self.group is not None,
        )

    def _execute(self, run: JobRun) -> JobResult:
        with self._lock:  # one job at a time
            return run.execute()

    def tokenization(self, job: TrainJob) -> Tokenization:
        """What a job's tokenized cache entries depend on: the engine's tokenizer (saved once per
        engine, with the mask token it may have added), the chat template and the length."""
        if self._saved_tokenizer is None:
            self._saved_tokenizer = save_tokenizer(self.tokenizer, self.data_dir / CACHE_DIR / "tokens")
        directory, digest = self._saved_tokenizer
        return Tokenization(str(directory), digest, job_template(job), self.config.seq_len)

    def save_compile_artifacts(self) -> int:
        """Write what warm-up compiled as portable artifacts to <data_dir>/compile-artifacts.bin,
        which a later build loads first; their size (0: nothing to save)."""
        return save_artifacts(self.data_dir / ARTIFACTS_FILE)

    def close(self) -> None:
        self.drafters.close()
        self.ready = False
        if self.parts is not None and self.parts.snapshot is not None:  # gigabytes of pinned host memory
            self.parts.snapshot.clear()
            self.parts.snapshot = None
        self.guard.release()
