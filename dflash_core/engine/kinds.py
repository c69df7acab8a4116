"""The run protocol every job kind implements, so a new kind of work adds a folder, not a branch
in the engine: the kinds and their run classes are listed once, in dflash_core/kinds.py. A job
names its kind in a `kind` attribute; a TrainJob has none (training is the default kind).

The protocol (`JobRun`): `validate(engine, job)` refuses what the engine cannot run, naming the
field (the service calls it before it queues the job); `run = cls(engine, job, callbacks,
resume_from)` holds that one job's state; `run.admit()` happens on the process that took the
job (checks and hands-offs before the run: a multi-host group's rank 0 sends it to the other
ranks); `run.execute()` runs it to its end, a cancel or a shutdown, on every rank that runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..kinds import UnknownKind, kind_of
from .api import JobCallbacks, JobError, JobResult

if TYPE_CHECKING:
    from .engine import Engine


class JobRun(Protocol):
    @classmethod
    def validate(cls, engine: Engine, job: Any) -> None: ...
    def __init__(self, engine: Engine, job: Any, callbacks: JobCallbacks, resume_from: str | None) -> None: ...
    def admit(self) -> None: ...
    def execute(self) -> JobResult: ...


def run_class(job: Any, multi_host: bool = False) -> type[JobRun]:
    """The run class of the job's kind; multi_host: the run is to be shared by a group's ranks,
    which only a kind the table marks multi-host may be."""
    try:
        found = kind_of(job)
    except UnknownKind as e:
        raise JobError(str(e), "kind") from None
    if multi_host and not found.multi_host:
        raise JobError(f"a {found.name} job runs on a daemon of one host, not in a multi-host group", "kind")
    return found.run_type()


@contextlib.contextmanager
def readable_failures(out_of_memory_hint: str = "") -> Iterator[None]:
    """Whatever a run raises becomes a JobError the user can read (its own JobErrors pass)."""
    try:
        yield
    except JobError:
        raise
    except torch.OutOfMemoryError as e:
        raise JobError(f"out of memory: {str(e).splitlines()[0]}{out_of_memory_hint}") from e
    except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
        raise JobError(f"{type(e).__name__}: {e}") from e
