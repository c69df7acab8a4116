"""Probes and metrics: GET /healthz (ready to run jobs), /livez (alive: restart the daemon when
not) and /metrics. Probes are async: they read memory only and must answer even when every worker
thread of the pool is busy (e.g. submissions waiting for the engine during a cold start)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .. import api_models as models
from ..metrics import CONTENT_TYPE
from . import RunningDaemon, doc

PATHS = ("/healthz", "/livez", "/metrics")  # all that a rank other than 0 serves
router = APIRouter()


@router.get(
    "/healthz",
    responses={
        200: doc("every drafter is warm: jobs run", models.Health),
        503: doc("starting, warming or failed (see status, phase and error)", models.Health),
    },
)
async def healthz(daemon: RunningDaemon) -> JSONResponse:
    assert daemon.host is not None  # set by Daemon.start(), which the lifespan runs before any request
    body = daemon.host.health()
    return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)


@router.get(
    "/livez",
    responses={
        200: doc("the process, its job worker and its engine threads are alive", models.Liveness),
        503: doc("something died (see problems): restart the daemon", models.Liveness),
    },
)
async def livez(daemon: RunningDaemon) -> JSONResponse:
    body = daemon.liveness()
    return JSONResponse(body, status_code=200 if body["status"] == "alive" else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format (README, Metrics)"}},
)
def metrics(daemon: RunningDaemon) -> Response:
    assert daemon.metrics is not None  # set by Daemon.start(), which the lifespan runs before any request
    return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)
