"""The HTTP routes, one router per concern: `health` (probes and metrics) and `jobs` (the job
API). Each route reads the parts of the running daemon it needs through a dependency below (the
job manager through RunningManager, a 503 while there is none), and
raises the service's own errors; service.http_errors turns those into answers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from .. import api_models as models
from ..daemon import Daemon
from ..jobs.errors import Unavailable
from ..jobs.manager import JobManager


async def _daemon(request: Request) -> Daemon:
    # async: a probe must answer even while every worker thread of the pool is busy
    return request.app.state.daemon


RunningDaemon = Annotated[Daemon, Depends(_daemon)]


async def running_manager(daemon: RunningDaemon) -> JobManager:
    """The daemon's job manager, or 503 (Unavailable) while it has none: Daemon.start() sets it, and
    the lifespan runs start before the app takes requests; a rank other than 0 has none (its
    app serves no job route). Async, as `_daemon`: it reads memory only."""
    if daemon.manager is None:
        raise Unavailable("the job API is not running (the daemon has not started its job manager)")
    return daemon.manager


RunningManager = Annotated[JobManager, Depends(running_manager)]


def doc(description: str, model: type = models.Error) -> dict[str, Any]:
    """A documented response: its description and the model of its JSON body."""
    return {"model": model, "description": description}
