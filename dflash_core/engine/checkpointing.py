"""A job's checkpoints: when to write one, the snapshot, the background write, waiting for it,
rotation of old ones, and reporting each one once it is complete.

The loop calls `Checkpointer.save(step, last=...)` after every step and `finish(step)` when it
leaves; everything else is decided here:
- cadence: every `checkpoint_interval` steps and at the last step; `finish` also writes the
  current step when the job stops early (cancel, shutdown) so that it resumes from there;
- snapshot: a copy of the fp32 master weights and the optimizer state of exactly one step into
  host buffers allocated once (by the engine from ready on, or when the job starts where nobody
  kept them) and reused by every checkpoint (pinned when the state lives on a GPU). The copies
  are launched on a side stream and training goes on at once:
  the next step's forward and backward only read the weights, and the replica's next optimizer
  step, the first write, waits on the GPU for the copies to finish (`DrafterReplica.write_guard`).
  The loop's pause is the launch, not the copy;
- background write: training goes on while the files are written, one write in flight at a time
  (the next snapshot first waits for the previous write, which bounds host memory to one
  snapshot);
- a checkpoint counts (is reported and may be resumed from) only once its directory has been
  renamed into place; rotation deletes old ones only after the newer one is reported.

Each write runs on its own daemon thread: a process that exits (after a shutdown timeout, say)
must not wait for it, and one killed mid-write leaves only a temporary directory.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import write_checkpoint
from ..confine import ConfinedDir, OutsideRoots
from ..target_identity import resolve_export_dtype, target_identity
from .api import JobCallbacks, JobError, StepStats
from .config import TrainJob
from .guards import check_checkpoint_weights
from .host_snapshot import HostSnapshot, expected_layout
from .replica import DrafterReplica

log = logging.getLogger("dflash.engine")


class CheckpointWriter:
    """At most one write in flight, on its own thread; finished writes reported in order."""

    def __init__(self) -> None:
        self._pending: tuple[cf.Future[str], int] | None = None

    def submit(self, write: Callable[[], str], step: int) -> None:
        """Start writing. Call `wait()` before taking the snapshot that `write` holds: one
        snapshot in host memory at a time."""
        if self._pending is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it first")
        future: cf.Future[str] = cf.Future()

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(write())
            except BaseException as e:  # noqa: BLE001 - handed to the loop through the future
                future.set_exception(e)

        threading.Thread(target=run, name=f"checkpoint-writer-step-{step}", daemon=True).start()
        self._pending = (future, step)

    def poll(self) -> list[tuple[str, int]]:
        """Checkpoints finished since the last call, without waiting; raises a failed write's error."""
        if self._pending is None or not self._pending[0].done():
            return []
        return self.wait()

    def wait(self) -> list[tuple[str, int]]:
        """Wait for the write in flight; [(path, step)] or []; raises a failed write's error."""
        if self._pending is None:
            return []
        future, step = self._pending
        self._pending = None
        return [(future.result(), step)]


def checkpoint_due(job: TrainJob, step: int, total: int) -> bool:
    """Whether step `step` of `total` ends with a checkpoint (every rank of a group asks)."""
    return step % job.checkpoint_interval == 0 or step == total


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory's name (step-00000120 -> 120), None for other names."""
    digits = name[5:]
    if not name.startswith("step-") or not (digits.isascii() and digits.isdigit()):
        return None
    return int(name[5:])


def rotate_checkpoints(directory: ConfinedDir, keep: int) -> list[str]:
    """Delete all but the newest `keep` step-* checkpoints of a job (by step number, not by name:
    names stop sorting by step past 10^8); the deleted paths. Through the directory's descriptor,
    and a symlink named like a checkpoint is removed itself, never followed."""
    steps = sorted((s, e.name) for e in directory.entries() if (s := checkpoint_step(e.name)) is not None)
    old = [name for _, name in steps[: max(0, len(steps) - keep)]]
    for name in old:
        directory.remove_tree(name)
    return [str(directory.path / name) for name in old]


def sweep_partial_writes(directory: ConfinedDir) -> list[str]:
    """Remove what an interrupted write left (.tmp-step-* and .old-step-* directories)."""
    names = [e.name for e in directory.entries() if e.name.startswith((".tmp-step-", ".old-step-"))]
    for name in names:
        directory.remove_tree(name)
    return names


@dataclass(frozen=True)
class RunPlan:
    """The run a checkpointer writes for, as its checkpoints record it: the steps, micro-batches
    per step and replicas (over every rank), and the checkpoint it resumed from, if any."""

    total_steps: int
    micro_batches_per_step: int
    replicas: int
    resumed_from: str | None = None


class Checkpointer:
    def __init__(
        self,
        job: TrainJob,
        replica: DrafterReplica,
        callbacks: JobCallbacks,
        plan: RunPlan,
        *,
        target_path: str,
        snapshot: HostSnapshot | None = None,
    ):
        """snapshot: host buffers the caller keeps across jobs (prepared from the engine's ready on,
        so a job does not pin gigabytes itself; its first checkpoint waits for them if they are
        not yet pinned); None: this job's own."""
        self.job = job
        self.replica = replica  # replicas are identical: the first one's state is the job's
        self.callbacks = callbacks
        self.total = plan.total_steps
        self.per_step = plan.micro_batches_per_step
        self.replicas = plan.replicas
        resumed_from = plan.resumed_from
        # what the checkpoints record of the target (never its path on this host), and the
        # dtype "auto" exports in
        self.target = target_identity(target_path)
        try:
            self.export_dtype = resolve_export_dtype(job.export_dtype, self.target["dtype"])
        except ValueError as e:
            raise JobError(str(e), "export_dtype") from None
        self.directory = job.output_path() / "checkpoints"
        try:  # checked now, not at the first checkpoint: an unusable output_dir fails the job before it trains
            self._dir = ConfinedDir(self.directory, job.output_roots, "output_dir")
        except OutsideRoots as e:
            raise JobError(str(e), "output_dir") from None
        except OSError as e:
            raise JobError(
                f"output_dir {job.output_dir!r} cannot be written: {e.strerror or e}", "output_dir"
            ) from None
        try:
            swept = sweep_partial_writes(self._dir)
            if swept:
                log.info(
                    "removed partial checkpoint writes",
                    extra={"fields": {"directory": str(self.directory), "names": swept}},
                )
            if resumed_from is not None:
                self._drop_newer_than(checkpoint_step(Path(resumed_from).name))
        except BaseException:
            self._dir.close()
            raise
        self.checkpoint_bytes = checkpoint_size(replica, self.export_dtype)
        self.last_path: str | None = resumed_from
        self._last_step: int | None = None
        self._writer = CheckpointWriter()
        self._own_buffers = snapshot is None
        self._snapshot_buffers = HostSnapshot() if snapshot is None else snapshot
        self._held = False  # the engine's pinning held by this job (__enter__)
        self._pauses: dict[int, float] = {}
        if snapshot is None:
            self._snapshot_buffers.prepare(expected_layout(replica))  # the last step always checkpoints

    def __enter__(self) -> Checkpointer:
        # the engine's pinning, if it still runs, waits while this job starts and takes its first
        # step, which would otherwise share the driver with it: the first save() releases it
        if not self._own_buffers:
            self._held = True
            self._snapshot_buffers.hold()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.release_hold()
        if kind is not None:  # the job is failing: a write in flight completes, nothing new starts
            self.abandon()

    def release_hold(self) -> None:
        """Let the engine's pinning go on (the first step is done, or the job waits for data)."""
        if self._held:
            self._held = False
            self._snapshot_buffers.release()

    def _drop_newer_than(self, step: int | None) -> None:
        """A resumed job recomputes the steps after its checkpoint: checkpoints of later steps on
        disk (written, but not recorded before the daemon died) are stale, and rotation must not
        keep them over the new ones."""
        if step is None:
            return
        stale = [e.name for e in self._dir.entries() if (s := checkpoint_step(e.name)) is not None and s > step]
        for name in stale:
            self._dir.remove_tree(name)
        if stale:
            log.info("removed checkpoints newer than the resume point", extra={"fields": {"names": stale}})

    def due(self, step: int) -> bool:
        return checkpoint_due(self.job, step, self.total)

    def save(
        self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None = None, *, force: bool = False
    ) -> None:
        """After step `step`: report writes that finished, and write this step if it is due."""
        self.release_hold()  # the first step is done: the engine's pinning goes on beside the next ones
        self._report(self._writer.poll())
        if not (force or self.due(step)) or self._last_step == step:
            return
        t = time.monotonic()
        self._report(self._writer.wait())  # the previous write first: one snapshot in memory
        self._writer.submit(self._snapshot(step, stats, eval_result), step)
        self._last_step = step
        self._pauses[step] = time.monotonic() - t  # training was stopped this long

    def finish(
        self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None, write_last: bool
    ) -> str | None:
        """Wait for the write in flight; with write_last (a job stopped early after it made
        progress) also write this step, so that the job resumes from there. The last checkpoint's path."""
        self.release_hold()
        if write_last:
            self.save(step, stats, eval_result, force=True)
        self._report(self._writer.wait())
        if self._own_buffers:
            self._snapshot_buffers.clear()
        self._dir.close()
        return self.last_path

    def abandon(self) -> None:
        """After a failure: let a write in flight finish (its directory is then complete or absent)."""
        self.release_hold()
        try:
            self._writer.wait()
        except Exception:  # noqa: BLE001 - the failure already propagating is the job's error
            log.exception("checkpoint write failed while the job was failing")
        if self._own_buffers:
            self._snapshot_buffers.clear()
        self._dir.close()

    def _report(self, done: list[tuple[str, int]]) -> None:
        """Report finished checkpoints, then rotate old ones away: never before the newer one is
        recorded (a resume picks the newest recorded one on disk)."""
        for path, at_step in done:
            self.callbacks.on_checkpoint(path, at_step, self._pauses.pop(at_step, 0.0))
        if not done:
            return
        self.last_path = done[-1][0]
        removed = rotate_checkpoints(self._dir, max(1, self.job.keep_checkpoints))
        if removed:
            self.callbacks.on_checkpoints_removed(removed)

    def _snapshot(self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None) -> Callable[[], str]:
        """Host copy of the weights and training state now (between steps: consistent), and the
        write of it, for the writer's thread."""
        rep = self.replica
        assert rep.optimizer is not None
        # the fp32 masters, not the bf16 working copies
        (weights, optimizer), copied = self._snapshot_buffers.copy((rep.weights_state(), rep.optimizer.state_dict()))
        if copied is not None:
            rep.write_guard = copied  # the replica's next optimizer step waits for the copies
        state = {
            "step": step,
            "total_steps": self.total,
            "micro_batch_index": step * self.per_step,
            "optimizer": optimizer,
            "torch_rng": torch.get_rng_state(),
            "replicas": self.replicas,
            "grad_accum": self.job.grad_accum,
        }
        meta = {
            "step": step,
            "total_steps": self.total,
            "loss": stats.loss if stats else None,
            "expected_acceptance_length": stats.expected_acceptance_length if stats else None,
            "eval_acceptance_length": (eval_result or {}).get("acceptance_length"),
            # DSpark: the confidence head's calibration on held-out data (recipes.dspark.calibrate)
            **(
                {"confidence_calibration": eval_result["confidence_calibration"]}
                if eval_result and "confidence_calibration" in eval_result
                else {}
            ),
            "target": self.target,
            "time": time.time(),
        }
        config = rep.drafter.config
        path = self.directory / step_dir_name(step)
        free = self._dir.free_bytes()
        if free < self.checkpoint_bytes:  # refuse before writing, rather than fail mid-file
            raise JobError(
                f"checkpoint {path} not written: {human_bytes(free)} free on the output_dir's file system, "
                f"a checkpoint needs about {human_bytes(self.checkpoint_bytes)} (ENOSPC)"
            )
        directory = self._dir
        export_dtype = self.export_dtype

        def write() -> str:
            if copied is not None:
                copied.synchronize()
            check_checkpoint_weights(step, weights)  # never a non-finite checkpoint, which rotation would keep
            try:
                return str(
                    write_checkpoint(
                        path,
                        config,
                        weights,
                        training_state=state,
                        metadata=meta,
                        parent=directory,
                        export_dtype=export_dtype,
                    )
                )
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobError(f"checkpoint {path} could not be written: {type(e).__name__}: {e}") from e

        return write


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB': readable for a tiny drafter's checkpoint and a large one alike."""
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def checkpoint_size(rep: DrafterReplica, export_dtype: str = "fp32") -> int:
    """Bytes a checkpoint of this replica takes on disk: the fp32 masters and AdamW's two fp32
    moments (12 bytes per parameter), plus a 16-bit export beside the masters (2 more; "auto"
    counts as one), plus a margin for the small files."""
    per_param = 12 + (2 if export_dtype != "fp32" else 0)
    return per_param * sum(m.numel() for _, m in rep.named_masters()) + (1 << 20)
