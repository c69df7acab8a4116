"""The HTTP control plane (docs/design.md, "HTTP API"): health, jobs, events, metrics.

`create_app(config)` returns the FastAPI app; its lifespan opens the store, starts the job worker
and starts the engine build in a background thread without awaiting it, so uvicorn answers
/healthz (503 while warming) from the first moment.
"""

from __future__ import annotations

import asyncio
import fcntl
import hmac
import json
import logging
import math
import os
import threading
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServiceConfig
from .engine_host import EngineHost
from .jobs.manager import JobConflict, JobManager, JobNotFound, Unavailable
from .jobs.schemas import InvalidSpec, SpecError, field_path, parse_spec
from .jobs.store import STATES, EventRecord, JobRecord, JobStore, SubmissionConflict
from .metrics import CONTENT_TYPE, ServiceMetrics

log = logging.getLogger("dflash.service")

EVENT_PAGE = 500
MAX_BODY_BYTES = 1 << 20  # a job spec is a few hundred bytes
FOLLOW_POLL_SECONDS = 0.25


class DataDirInUse(RuntimeError):
    pass


class _DataDirLock:
    """One daemon per data directory: two would both run the queue's jobs."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DataDirInUse(
                f"another dflash-trainer daemon (pid {holder}) is using data dir {self.path.parent}"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Daemon:
    """Everything the app owns for its lifetime."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.lock = _DataDirLock(config.data_dir)
        self.store: JobStore | None = None
        self.host: EngineHost | None = None
        self.manager: JobManager | None = None
        self.metrics: ServiceMetrics | None = None
        self._shutting_down = threading.Event()

    def start(self) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        self.store = JobStore(self.config.database_path)
        self.host = EngineHost(self.config)
        self.manager = JobManager(self.config, self.store, self.host)
        self.metrics = ServiceMetrics(self.host, self.store, block_size=self.config.engine.block_size)
        self.manager.metrics = self.metrics
        self.manager.start()
        self.host.start()
        log.info(
            "daemon started",
            extra={"fields": {"data_dir": str(self.config.data_dir), "database": str(self.config.database_path)}},
        )

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down.is_set()

    def begin_shutdown(self) -> None:
        """Called on SIGTERM/SIGINT, before uvicorn drains connections: stops the running job at its
        next step (checkpointed, resumable) and ends event streams."""
        self._shutting_down.set()
        if self.manager is not None:
            self.manager.begin_shutdown()

    def stop(self) -> None:
        self._shutting_down.set()
        if self.manager is not None:
            self.manager.shutdown(self.config.shutdown_timeout_seconds)
            if self.manager.worker_alive:
                # the job is still inside a step: closing the engine or the database under it would
                # turn a clean resume into a crash; the process exit ends it, and the next start resumes
                log.error("job worker still busy at exit; leaving engine and database open")
                self.lock.release()
                return
        if self.host is not None:
            self.host.close()
        if self.store is not None:
            self.store.close()
        self.lock.release()
        log.info("daemon stopped")


# --------------------------------------------------------------------------- JSON shapes
def _iso(t: float | None) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z") if t is not None else None


def finite(value: Any) -> Any:
    """NaN/inf (a diverged loss) -> null, recursively: responses stay strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def job_json(job: JobRecord) -> dict[str, Any]:
    total = job.total_steps
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "submission_id": job.submission_id,
        "state": job.state,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "queue_position": job.queue_position,
        "progress": {
            "phase": job.phase if job.state == "RUNNING" else None,
            "data": job.data,
            "step": job.step,
            "total_steps": total,
            "fraction": round(job.step / total, 4) if total else None,
            "loss": job.loss,
            "tokens_per_second": job.tokens_per_second,
            "expected_acceptance_length": job.expected_acceptance_length,
            "eval_acceptance_length": job.eval_acceptance_length,
            "learning_rate": job.learning_rate,
            "epoch": job.epoch,
            "last_checkpoint": job.last_checkpoint,
            "last_checkpoint_step": job.last_checkpoint_step,
        },
        "error": job.error,
        "cancel_requested": job.cancel_requested,
        "resumes": job.resumes,
        "output_dir": job.output_dir,
        "spec": job.spec,
    }
    if job.checkpoints is not None:
        out["checkpoints"] = [{"step": c["step"], "path": c["path"], "time": _iso(c["time"])} for c in job.checkpoints]
    return finite(out)


def event_json(event: EventRecord) -> dict[str, Any]:
    return finite(
        {
            **event.payload,
            "event_id": event.id,
            "job_id": event.job_id,
            "time": event.time,
            "kind": event.kind,
            "step": event.step,
        }
    )


def _error(status: int, detail: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers)


def _invalid_query(name: str, message: str) -> JSONResponse:
    return _error(422, f"invalid request: {name}: {message}", errors=[{"field": name, "message": message}])


def _invalid(errors: list[dict[str, str]]) -> JSONResponse:
    detail = "invalid job spec: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return _error(422, detail, errors=errors)


# --------------------------------------------------------------------------- app
def create_app(config: ServiceConfig) -> FastAPI:
    daemon = Daemon(config)

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
    )
    app.state.daemon = daemon

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            loc = tuple(e.get("loc", ()))
            if loc and loc[0] in ("query", "path", "body", "header"):
                loc = loc[1:]
            errors.append({"field": field_path(loc) or "request", "message": e.get("msg", "invalid")})
        detail = "invalid request: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return _error(422, detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    def _unauthorized(request: Request) -> JSONResponse | None:
        token = config.auth_token
        if token is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return _error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")
        return None

    # ------------------------------------------------------------------ health
    # Probes are async: they read memory only and must answer even when every worker thread of
    # the pool is busy (e.g. submissions waiting for the engine during a cold start).
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        assert daemon.host is not None  # set by daemon.start(), which the lifespan runs before any request
        body = daemon.host.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        assert daemon.manager is not None and daemon.host is not None  # set by daemon.start() (lifespan)
        problems = []
        if not daemon.manager.worker_alive and not daemon.shutting_down:
            problems.append("the job worker thread died")
        status = daemon.host.engine_status()
        if daemon.host.ready and status is not None and not status.threads_alive and not daemon.shutting_down:
            problems.append("an engine drafter thread died")
        if daemon.host.failed:
            problems.append(f"the engine failed to start: {daemon.host.error}")
        body: dict[str, Any] = {
            "status": "alive" if not problems else "dead",
            "engine": daemon.host.status(),
            "job_worker_alive": daemon.manager.worker_alive,
            "engine_build_running": daemon.host.build_thread_alive,
        }
        if problems:
            body["problems"] = problems
        return JSONResponse(body, status_code=200 if not problems else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        assert daemon.metrics is not None  # set by daemon.start(), which the lifespan runs before any request
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ jobs
    @app.post("/jobs")
    async def submit_job(request: Request) -> JSONResponse:
        if (denied := _unauthorized(request)) is not None:
            return denied
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, f"job spec of {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
        try:
            body = json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _invalid([{"field": "body", "message": f"not valid JSON: {e}"}])
        except (RecursionError, ValueError) as e:  # absurdly nested or huge numbers
            return _invalid([{"field": "body", "message": f"not a usable JSON document ({type(e).__name__})"}])
        if body is None:
            return _invalid([{"field": "body", "message": "empty body; send the job spec as a JSON object"}])
        assert daemon.manager is not None  # set by daemon.start(), which the lifespan runs before any request
        try:
            spec = parse_spec(body)
            job, created = await run_in_threadpool(daemon.manager.submit, spec)
        except InvalidSpec as e:
            return _invalid(e.errors)
        except SpecError as e:
            return _invalid([{"field": e.field, "message": e.message}])
        except SubmissionConflict as e:
            return _error(409, str(e), job=job_json(e.existing))
        except JobConflict as e:
            return _error(409, str(e))
        except Unavailable as e:
            return _error(503, str(e))
        return JSONResponse(job_json(job), status_code=202 if created else 200)

    @app.get("/jobs")
    def list_jobs(
        state: str | None = Query(None, description="only jobs in this state"),
        limit: int = Query(1000, ge=1, le=100_000, description="the newest this many jobs"),
    ) -> JSONResponse:
        if state is not None and state.upper() not in STATES:
            return _invalid_query("state", f"{state!r} is not one of {', '.join(STATES)}")
        assert daemon.store is not None  # set by daemon.start(), which the lifespan runs before any request
        jobs = daemon.store.list_jobs(state=state.upper() if state else None, limit=limit)
        return JSONResponse({"jobs": [job_json(j) for j in jobs]})

    @app.get("/jobs/{job_id}")
    def get_job(job_id: str) -> JSONResponse:
        assert daemon.store is not None  # set by daemon.start(), which the lifespan runs before any request
        job = daemon.store.get_job(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return JSONResponse(job_json(job))

    @app.post("/jobs/{job_id}/cancel")
    def cancel_job(request: Request, job_id: str) -> JSONResponse:
        if (denied := _unauthorized(request)) is not None:
            return denied
        assert daemon.manager is not None  # set by daemon.start(), which the lifespan runs before any request
        try:
            job = daemon.manager.cancel(job_id)
        except JobNotFound:
            return _error(404, f"no job {job_id!r}")
        except JobConflict as e:
            return _error(409, str(e))
        # a queued job is STOPPED now (200); a running one stops at its next step (202)
        return JSONResponse(job_json(job), status_code=200 if job.terminal else 202)

    @app.get("/jobs/{job_id}/events")
    async def job_events(
        job_id: str,
        follow: bool = Query(False, description="keep streaming until the job ends"),
        after: int = Query(0, ge=0, le=2**63 - 1, description="only events with event_id greater than this"),
        kind: list[str] | None = Query(None, description="only these kinds (repeatable), e.g. step"),
    ) -> Response:
        store = daemon.store
        assert store is not None  # set by daemon.start(), which the lifespan runs before any request
        job = await run_in_threadpool(store.get_job, job_id, with_checkpoints=False)
        if job is None:
            return _error(404, f"no job {job_id!r}")

        async def lines():
            last = after
            while True:
                current = await run_in_threadpool(store.get_job, job_id, with_checkpoints=False)
                ended = current is None or current.terminal  # read before draining: no event is missed
                while True:
                    page = await run_in_threadpool(store.events, job_id, after=last, kinds=kind, limit=EVENT_PAGE)
                    for event in page:
                        last = event.id
                        yield json.dumps(event_json(event)) + "\n"
                    if len(page) < EVENT_PAGE:
                        break
                if not follow or ended or daemon.shutting_down:
                    return
                await asyncio.sleep(FOLLOW_POLL_SECONDS)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app
