"""Where a job's time before its first step goes: marks taken as the job prepares (data opened,
micro-batches planned, weights and optimizer ready, checkpoint buffers, pipeline started, first
step done), reported once as seconds per phase in the job's events and the log, so a slow first
step says which phase it waited in."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("dflash.engine")


class StartClock:
    def __init__(self) -> None:
        self._last = self._t0 = time.monotonic()
        self.phases: dict[str, float] = {}
        self.reported = False

    def mark(self, phase: str) -> None:
        """The phase that ends now (its seconds: since the previous mark)."""
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._last, 3)
        self._last = now

    def breakdown(self) -> dict[str, float]:
        return {**self.phases, "total": round(self._last - self._t0, 3)}

    def first_step(self, on_event) -> None:
        """Once, when the first step is done: the breakdown as a `first_step` event
        (on_event(kind, fields)) and a log line; nothing after the first."""
        if self.reported:
            return
        self.reported = True
        self.mark("first_step")
        fields = self.breakdown()
        on_event("first_step", {"seconds": fields})
        log.info("job's first step", extra={"fields": {f"{k}_s": v for k, v in fields.items()}})
