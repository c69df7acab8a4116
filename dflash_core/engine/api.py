"""The engine's public types: what a job reports while it runs, what it returns, the status the
daemon reads, and the one error type engine and service share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class JobError(Exception):
    """A job that cannot run or could not finish, with a message meant for the user.

    `field` names the job spec field at fault when the job was refused before it started (the
    service answers 422); it is None for a failure while the job ran. `resumable`: the job did
    nothing wrong (a rank of a multi-host group was lost) and continues from its last checkpoint
    once the group is whole again."""

    def __init__(self, message: str, field: str | None = None, resumable: bool = False):
        self.field = field
        self.message = message
        self.resumable = resumable
        super().__init__(f"{field}: {message}" if field else message)


@dataclass(frozen=True)
class WarmupRecord:
    component: str  # target_load | target | drafter
    device: str
    seconds: float


@dataclass(frozen=True)
class EngineStatus:
    """One consistent reading of the engine for health checks and metrics (cheap: no device sync)."""

    phase: str  # starting | loading_target | warming_target | warming_drafters | ready
    ready: bool
    drafters_ready: int
    drafters_total: int
    elapsed_seconds: float  # since the engine was created
    warmup: tuple[WarmupRecord, ...]
    compiles: dict[str, int]  # {"warmup": n, "runtime": n}; any runtime compile is a bug
    drafter_devices: tuple[str, ...]
    tokens_per_device: dict[str, int]  # context tokens trained since start
    tokens_per_second: float  # over the recent steps of the running job
    queue_depths: dict[str, int]  # micro-batches waiting per drafter (empty between jobs)
    threads_alive: bool  # every worker thread started after warm-up is running
    allocator: dict[str, dict[str, int]]  # CUDA caching-allocator gauges per device (none on CPU)
    # the checkpoint snapshot's pinned host buffers, allocated from ready on: none (no GPU state
    # to pin, or a rank that does not checkpoint) | pinning | pinned | failed (the first checkpoint pins them)
    checkpoint_buffers: str = "none"
    # multi-host (one process: rank 0 of 1): this process's rank, the group's size, the ranks rank 0
    # sees warm and beating (other ranks: themselves), and why the group cannot train, if it cannot
    rank: int = 0
    ranks_total: int = 1
    ranks_ready: int = 0
    group_problem: str | None = None


@dataclass(kw_only=True)
class StepStats:
    """One optimizer step's statistics (built by keyword: fourteen values in a row are easy to
    misorder)."""

    step: int  # steps completed (1-based)
    total_steps: int
    loss: float
    position_accuracy: list[float]  # per drafted token of a block, in order
    expected_acceptance_length: float
    context_tokens: int
    tokens_per_device: dict[str, int]
    step_seconds: float
    seconds_per_device: dict[str, float]
    tokens_per_second: float
    learning_rate: float
    grad_norm: float
    epoch: float
    labels: int = 0  # block positions with a label (a weight in the loss): what the step trained on


class JobCallbacks:
    """Hooks a job calls from its thread; override what you need."""

    def on_step(self, stats: StepStats) -> None: ...
    def on_checkpoint(self, path: str, step: int, pause_seconds: float = 0.0) -> None:
        """A checkpoint is complete on disk; training stood still pause_seconds to take it."""

    def on_checkpoints_removed(self, paths: list[str]) -> None: ...
    def on_event(self, kind: str, payload: dict[str, Any]) -> None: ...
    def on_eval(self, step: int, result: dict[str, Any]) -> None: ...
    def on_data_progress(self, progress: dict[str, Any]) -> None: ...
    def on_generate(self, progress: dict[str, Any]) -> None:
        """A regeneration's progress: rows and prompts done of total, tokens, tokens/s, ETA."""

    def on_records(self, progress: dict[str, Any]) -> None:
        """A continual job's records: ingested so far, waiting to be trained, spool lines read."""

    def on_publish(self, result: dict[str, Any]) -> None:
        """A continual job's publish decision: candidate and published acceptance lengths, and
        whether (and as which version, where) it published."""

    def on_target_swap(self, result: dict[str, Any]) -> None:
        """A continual job loaded a new target version in place (its seconds), or refused one (why)."""

    def should_cancel(self) -> bool:
        return False

    def should_yield(self) -> bool:
        """Another job waits for the devices (a job that does not end gives them up for it)."""
        return False


@dataclass
class JobResult:
    status: str  # SUCCEEDED | STOPPED | YIELDED (gave the devices to a queued job; resumes after it)
    steps_done: int
    total_steps: int
    final_checkpoint: str | None
    last_stats: StepStats | None = None
    eval: dict[str, Any] | None = None
    skipped_lines: int = 0
