"""The tokenizer worker processes: they never outlive the daemon, and a cancel reaches them at once.

- Each worker asks the kernel to kill it when the thread that started it ends
  (PR_SET_PDEATHSIG, Linux): a daemon killed with SIGKILL while tokenizing leaves no worker
  holding a tokenizer's memory. The pool is created, fed and shut down on one thread (the job's),
  which outlives its workers. A worker whose parent is already gone when it starts exits.
- A cancel does not wait for the chunks in flight (seconds to minutes each on a large dataset):
  the parent stops waiting within STOP_POLL_SECONDS and terminates the workers.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

STOP_POLL_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1

_T = TypeVar("_T")


def _die_with_parent(parent: int) -> None:
    """Worker initializer."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def worker_pool(workers: int) -> cf.ProcessPoolExecutor:
    """Spawned (not forked: the daemon has threads) workers that die with the daemon."""
    return cf.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_die_with_parent,
        initargs=(os.getpid(),),
    )


def result_or_stop(future: cf.Future[_T], should_stop: Callable[[], bool], stopped: type[Exception]) -> _T:
    """The future's result; raises `stopped` as soon as should_stop() says so."""
    while True:
        try:
            return future.result(timeout=STOP_POLL_SECONDS)
        except cf.TimeoutError:
            if should_stop():
                raise stopped from None


def stop_workers(pool: cf.ProcessPoolExecutor) -> None:
    """Terminate the pool's workers now (their chunks in flight are abandoned); the pool is then
    broken and its shutdown returns without waiting for them."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(Exception):
            process.terminate()
