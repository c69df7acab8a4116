"""A switch that is on in one thread only: the target's fused layers and norm kernels answer
through it, so the thread that turns them on (a recorded capture, the regeneration decoder) gets
them while every other thread using the same modules runs their own forward."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class ThreadSwitch:
    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def is_on(self) -> bool:
        """Whether the calling thread is inside `on()`."""
        return getattr(self._local, "on", False)

    @property
    def value(self) -> Any:
        """What the calling thread turned the switch on with (None when off)."""
        return getattr(self._local, "value", None)

    @contextlib.contextmanager
    def on(self, value: Any = None) -> Iterator[Any]:
        """On in the calling thread for the block, carrying `value` for it (yielded; nested
        blocks leave both as they found them)."""
        before = self.is_on, self.value
        self._local.on, self._local.value = True, value
        try:
            yield value
        finally:
            self._local.on, self._local.value = before

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a copy starts off: thread state is not copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = threading.local()
