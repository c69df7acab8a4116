"""Readers for the service's metrics (no prometheus here): a tokens/s meter over recent steps and
the CUDA caching-allocator statistics of each device (thread-safe, no device sync)."""

from __future__ import annotations

import collections
import threading
import time

import torch


class RateMeter:
    """Tokens per second of training over the steps of a sliding window: tokens over the steps'
    own durations, so a pause between steps (a checkpoint, an evaluation) does not lower it;
    pauses are measured on their own."""

    def __init__(self, window_seconds: float = 30.0, max_points: int = 256):
        self.window = window_seconds
        self._points: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=max_points)
        self._lock = threading.Lock()

    def add(self, tokens: int, seconds: float, now: float | None = None) -> None:
        """One step of `tokens` that took `seconds`."""
        with self._lock:
            self._points.append((now if now is not None else time.monotonic(), tokens, seconds))

    def rate(self, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        with self._lock:
            pts = [(n, s) for t, n, s in self._points if now - t <= self.window]
        busy = sum(s for _, s in pts)
        return sum(n for n, _ in pts) / busy if busy > 0 else 0.0

    def reset(self) -> None:
        with self._lock:
            self._points.clear()


ALLOCATOR_FIELDS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
    "device_allocs": "num_device_alloc",
}


def allocator_stats(device: str | torch.device) -> dict[str, int]:
    """CUDA caching-allocator gauges of one device; empty for non-CUDA devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_FIELDS.items()}
