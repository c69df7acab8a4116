"""Turns at the tokenizer between a continual job's two threads.

The ingest thread tokenizes record after record; the job's thread needs the same tokenizer now and
then (the answered prompts; and, from the drafter's thread that runs them for it, the evaluation
that decides a publish and the drift measured after a target swap, which take a turn per prompt,
not for the whole evaluation), and a fast tokenizer is not safe to call from two threads at once. With a plain lock
held per record, the ingest thread would take it back the moment it let go, before the waiting
job's thread woke, so a file of many records would keep the job's thread waiting to its end. Here
the job's thread asks first: once it waits, the ingest thread takes no new turn, and the job's
thread waits for one record at most.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class TokenizerTurns:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None  # the thread holding the tokenizer
        self._depth = 0  # its nested turns: the job's thread tokenizes answers inside its own turn
        self._asking = 0  # job's-thread turns waiting: the ingest thread takes none meanwhile

    @contextmanager
    def first(self) -> Iterator[None]:
        """A turn that the ingest thread lets go first (the job's thread, or a thread working for it)."""
        with self._cond:
            self._asking += 1
            try:
                self._take(lambda: True)
            finally:
                self._asking -= 1
                self._cond.notify_all()  # a waiting ingest turn looks again (this one may have given up)
        try:
            yield
        finally:
            self._give_back()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A turn behind any `first` one waiting (the ingest thread's, per record)."""
        with self._cond:
            self._take(lambda: self._asking == 0)
        try:
            yield
        finally:
            self._give_back()

    def _take(self, allowed: Callable[[], bool]) -> None:
        me = threading.get_ident()
        if self._holder == me:  # nested: the thread already holds the tokenizer
            self._depth += 1
            return
        self._cond.wait_for(lambda: self._holder is None and allowed())
        self._holder, self._depth = me, 1

    def _give_back(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._cond.notify_all()
