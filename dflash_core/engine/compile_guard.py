"""Compile accounting and the post-warmup guard.

torch.compile is not thread-safe and, past its recompile limit, silently falls back to eager
(for flex_attention: the unfused O(S^2) path). After warmup every compile is a bug, so we count
compiled graphs by phase and switch dynamo to `fail_on_recompile`, which turns any new compile
(in any thread) into a RuntimeError instead of a silent recompile.
"""
from __future__ import annotations

import threading

import torch


def compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # dynamo unavailable: nothing is ever compiled
        return 0
    return int(counters["stats"]["unique_graphs"])


class CompileGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = compiled_graphs()
        self._warm_end: int | None = None
        self._enforcing = False

    def end_warmup(self, enforce: bool) -> None:
        with self._lock:
            self._warm_end = compiled_graphs()
        if enforce and hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("fail_on_recompile")
            self._enforcing = True

    def release(self) -> None:
        """Back to dynamo's default stance (the stance is process-wide; the engine is closing)."""
        if self._enforcing:
            torch.compiler.set_stance("default")
            self._enforcing = False

    def counts(self) -> dict[str, int]:
        now = compiled_graphs()
        with self._lock:
            if self._warm_end is None:
                return {"warmup": now - self._start, "runtime": 0}
            return {"warmup": self._warm_end - self._start, "runtime": now - self._warm_end}
