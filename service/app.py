"""The HTTP control plane (docs/design.md, "HTTP contract"): health, jobs, events, metrics.

`create_app(config)` returns the FastAPI app; its lifespan starts the daemon (service.daemon: the
store, the job worker, and the engine build in a background thread, not awaited), so uvicorn
answers /healthz (503 while warming) from the first moment. Every request passes service.http_guard
first (Host, Origin, token, Content-Type, body size); the routes live in service.routes, their
errors become answers in service.http_errors, and the served /openapi.json (service.openapi)
describes the guard's answers too.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from dflash_core.engine.launch import Launch

from .config import ServiceConfig
from .daemon import Daemon, DataDirInUse
from .http_errors import HANDLERS, error
from .http_guard import RequestGuard
from .openapi import guarded_openapi
from .routes import health, jobs, records

__all__ = ["DataDirInUse", "create_app"]


def create_app(config: ServiceConfig, launch: Launch | None = None) -> FastAPI:
    """The daemon's app; `launch`: its place in a multi-host group (None: one process)."""
    daemon = Daemon(config, launch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(daemon.start)
        try:
            yield
        finally:
            await asyncio.to_thread(daemon.stop)

    app = FastAPI(
        title="dflash-trainer",
        version="0.1.0",
        lifespan=lifespan,
        description="Training daemon for DFlash speculative-decoding drafters",
        exception_handlers=HANDLERS,
    )
    app.state.daemon = daemon
    app.add_middleware(RequestGuard, config=config)
    routers = [health.router] if daemon.follower else [health.router, jobs.router, records.router]
    for router in routers:
        app.include_router(router)
    app.state.routes = [route for router in routers for route in router.routes]  # what a 405 names
    if daemon.follower:
        assert launch is not None
        _serve_probes_only(
            app, f"rank {launch.rank} of {launch.world} serves /healthz, /livez and /metrics; the job API is on rank 0"
        )
    app.openapi = lambda: guarded_openapi(app, config)  # type: ignore[method-assign]
    return app


def _serve_probes_only(app: FastAPI, why: str) -> None:
    """A rank other than 0 answers its probes and metrics; anything else is a 404 saying where to go."""

    @app.middleware("http")
    async def probes_only(request: Request, call_next):
        if request.url.path not in health.PATHS:
            return error(404, why)
        return await call_next(request)
