"""Probes and metrics: GET /healthz (ready to run jobs), /livez (alive: restart the daemon when
not) and /metrics. Probes are async: they read memory only and must answer even when every worker
thread of the pool is busy (e.g. submissions waiting for the engine during a cold start)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .. import api_models as models
from ..metrics import CONTENT_TYPE
from . import RunningDaemon, doc

PATHS = ("/healthz", "/livez", "/metrics")  # all that a rank other than 0 serves
router = APIRouter()


def _probe(model: type, ok: str, not_ok: str) -> dict[int | str, dict[str, Any]]:
    """A probe's answers: 200 when it passes, 503 when not, both with the same body."""
    return {200: doc(ok, model), 503: doc(not_ok, model)}


def _answer(body: dict[str, Any], passes: bool) -> JSONResponse:
    return JSONResponse(body, status_code=200 if passes else 503)


@router.get(
    "/healthz",
    responses=_probe(
        models.Health, "every drafter is warm: jobs run", "starting, warming or failed (see status, phase and error)"
    ),
)
async def healthz(daemon: RunningDaemon) -> JSONResponse:
    assert daemon.host is not None  # set by Daemon.start(), which the lifespan runs before any request
    body = daemon.host.health()
    return _answer(body, body["status"] == "ready")


@router.get(
    "/livez",
    responses=_probe(
        models.Liveness,
        "the process, its job worker and its engine threads are alive",
        "something died (see problems): restart the daemon",
    ),
)
async def livez(daemon: RunningDaemon) -> JSONResponse:
    body = daemon.liveness()
    return _answer(body, body["status"] == "alive")


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format (README, Metrics)"}},
)
def metrics(daemon: RunningDaemon) -> Response:
    assert daemon.metrics is not None  # set by Daemon.start(), which the lifespan runs before any request
    return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)
