"""The run protocol every job kind implements, so a new kind of work adds a folder, not a branch
in the engine: the kinds and their run classes are listed once, in dflash_core/kinds.py. A job
names its kind in a `kind` attribute; a TrainJob has none (training is the default kind).

The protocol (`JobRun`): `validate(context, job)` refuses what the engine cannot run, naming
the field (the service calls it before it queues the job); `run = cls(context, job, callbacks,
resume_from)` holds that one job's state; `run.admit()` happens on the process that took the
job (checks and hands-offs before the run: a multi-host group's rank 0 sends it to the other
ranks); `run.execute()` runs it to its end, a cancel or a shutdown, on every rank that runs it.
A run sees the engine only as the job's RunContext (context.py), never the engine itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..kinds import UnknownKind, kind_of
from .api import JobCallbacks, JobError, JobResult
from .context import RunContext


class JobRun(Protocol):
    @classmethod
    def validate(cls, context: RunContext, job: Any) -> None: ...
    def __init__(self, context: RunContext, job: Any, callbacks: JobCallbacks, resume_from: str | None) -> None: ...
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
