"""Checkpoint files written beside the training loop, so training continues while they are written.

The training loop takes a CPU snapshot between steps (weights, optimizer state: a consistent
state, nothing runs on the drafters then) and hands the write to this writer. At most one write
is in flight, and the loop waits for it before taking the next snapshot, which bounds host
memory to one snapshot. A checkpoint counts (is reported, may be resumed from) only once its
directory has been renamed into place; a failed write fails the job at the next step.

Each write runs on its own daemon thread: a process that exits (after a shutdown timeout, say)
must not wait for a write, and one killed mid-write leaves only a temporary directory.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Callable


class CheckpointWriter:
    def __init__(self) -> None:
        self._pending: tuple[cf.Future, int] | None = None

    def submit(self, write: Callable[[], str], step: int) -> None:
        """Start writing. Call `wait()` before taking the snapshot that `write` holds: one
        snapshot in host memory at a time."""
        if self._pending is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it first")
        future: cf.Future = cf.Future()

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
