"""When a run evaluates its drafter on held-out prompts, asked `due(step)` after each step, as
the checkpointer is (engine/checkpointing.py: checkpoint_due)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSchedule:
    """Every `interval` steps (0: not by count) and at the run's last step, `total` (None: a run
    without an end); never when not `enabled` (no held-out prompts, or not this rank's to do)."""

    interval: int
    total: int | None = None
    enabled: bool = True

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        return (self.interval > 0 and step % self.interval == 0) or step == self.total
