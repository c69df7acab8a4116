"""A job's checkpoints: when to write one, the snapshot, the background write, waiting for it,
rotation of old ones, and reporting each one once it is complete.

The loop calls `Checkpointer.save(step, last=...)` after every step and `finish(step)` when it
leaves; everything else is decided here:
- cadence: every `checkpoint_interval` steps and at the last step; `finish` also writes the
  current step when the job stops early (cancel, shutdown) so that it resumes from there;
- snapshot: a host copy of the fp32 master weights and the optimizer state taken between two
  steps, when nothing runs on the drafters (a consistent state of exactly one step);
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
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import cpu_copy, write_checkpoint
from .api import JobCallbacks, JobError, StepStats
from .config import TrainJob
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


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rotate_checkpoints(directory: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` step-* checkpoints of a job; the deleted paths."""
    old = sorted(p for p in directory.iterdir() if p.name.startswith("step-"))[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in old]


class Checkpointer:
    def __init__(
        self,
        job: TrainJob,
        replica: DrafterReplica,
        callbacks: JobCallbacks,
        *,
        total_steps: int,
        micro_batches_per_step: int,
        replicas: int,
        target_path: str,
        resumed_from: str | None = None,
    ):
        self.job = job
        self.replica = replica  # replicas are identical: the first one's state is the job's
        self.callbacks = callbacks
        self.total = total_steps
        self.per_step = micro_batches_per_step
        self.replicas = replicas
        self.target_path = target_path
        self.directory = job.output_path() / "checkpoints"
        self.last_path: str | None = resumed_from
        self._last_step: int | None = None
        self._writer = CheckpointWriter()

    def due(self, step: int) -> bool:
        return step % self.job.checkpoint_interval == 0 or step == self.total

    def save(
        self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None = None, *, force: bool = False
    ) -> None:
        """After step `step`: report writes that finished, and write this step if it is due."""
        self._report(self._writer.poll())
        if not (force or self.due(step)) or self._last_step == step:
            return
        self._report(self._writer.wait())  # the previous write first: one snapshot in memory
        self._writer.submit(self._snapshot(step, stats, eval_result), step)
        self._last_step = step

    def finish(
        self,
        step: int,
        stats: StepStats | None,
        eval_result: dict[str, Any] | None,
        *,
        stopped_early: bool,
        first_step: int,
    ) -> str | None:
        """Wait for the write in flight; a job stopped early also writes its current step (if it
        made progress), so that it resumes from there. The last checkpoint's path."""
        if stopped_early and step > first_step:
            self.save(step, stats, eval_result, force=True)
        self._report(self._writer.wait())
        return self.last_path

    def abandon(self) -> None:
        """After a failure: let a write in flight finish (its directory is then complete or absent)."""
        try:
            self._writer.wait()
        except Exception:  # noqa: BLE001 - the failure already propagating is the job's error
            log.exception("checkpoint write failed while the job was failing")

    def _report(self, done: list[tuple[str, int]]) -> None:
        """Report finished checkpoints, then rotate old ones away: never before the newer one is
        recorded (a resume picks the newest recorded one on disk)."""
        for path, at_step in done:
            self.callbacks.on_checkpoint(path, at_step)
        if not done:
            return
        self.last_path = done[-1][0]
        removed = rotate_checkpoints(self.directory, max(1, self.job.keep_checkpoints))
        if removed:
            self.callbacks.on_checkpoints_removed(removed)

    def _snapshot(self, step: int, stats: StepStats | None, eval_result: dict[str, Any] | None) -> Callable[[], str]:
        """Host copy of the weights and training state now (between steps: consistent), and the
        write of it, for the writer's thread."""
        rep = self.replica
        assert rep.optimizer is not None
        weights = cpu_copy(rep.weights_state())  # the fp32 masters, not the bf16 working copies
        state = cpu_copy(
            {
                "step": step,
                "total_steps": self.total,
                "micro_batch_index": step * self.per_step,
                "optimizer": rep.optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "replicas": self.replicas,
                "grad_accum": self.job.grad_accum,
            }
        )
        meta = {
            "step": step,
            "total_steps": self.total,
            "loss": stats.loss if stats else None,
            "expected_acceptance_length": stats.expected_acceptance_length if stats else None,
            "eval_acceptance_length": (eval_result or {}).get("acceptance_length"),
            "target": self.target_path,
            "time": time.time(),
        }
        config = rep.drafter.config
        path = self.directory / step_dir_name(step)

        def write() -> str:
            try:
                return str(write_checkpoint(path, config, weights, training_state=state, metadata=meta))
            except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
                raise JobError(f"checkpoint {path} could not be written: {type(e).__name__}: {e}") from e

        return write
