"""The HTTP routes, one router per concern: `health` (probes and metrics) and `jobs` (the job
API). Each route reads the parts of the running daemon it needs through a dependency below, and
raises the service's own errors; service.http_errors turns those into answers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from .. import api_models as models
from ..daemon import Daemon


async def _daemon(request: Request) -> Daemon:
    # async: a probe must answer even while every worker thread of the pool is busy
    return request.app.state.daemon


RunningDaemon = Annotated[Daemon, Depends(_daemon)]


def doc(description: str, model: type = models.Error) -> dict[str, Any]:
    """A documented response: its description and the model of its JSON body."""
    return {"model": model, "description": description}
