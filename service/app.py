"""The HTTP control plane (docs/design.md, "HTTP API"): health, jobs, events, metrics.

`create_app(config)` returns the FastAPI app; its lifespan opens the store, starts the job worker
and starts the engine build in a background thread without awaiting it, so uvicorn answers
/healthz (503 while warming) from the first moment. Every request passes service.http_guard first
(Host, Origin, token, Content-Type, body size); the served /openapi.json describes the responses,
those of the guard included (`_openapi`).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import math
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from dflash_core.engine.launch import Launch

from . import api_models as models
from .config import ServiceConfig
from .engine_host import EngineHost
from .event_feed import EVENT_PAGE, EventHub, TooManyStreams
from .http_guard import MAX_BODY_BYTES, SAFE_METHODS, UNGUARDED_READS, RequestGuard, token_matches
from .jobs.manager import JobConflict, JobManager, JobNotFound, Unavailable
from .jobs.regenerate_spec import RegenerateSpec
from .jobs.schemas import InvalidSpec, JobSpec, SpecError, field_path, parse_spec
from .jobs.store import STATES, EventRecord, JobRecord, JobStore, SubmissionConflict
from .metrics import CONTENT_TYPE, ServiceMetrics

log = logging.getLogger("dflash.service")

NDJSON = "application/x-ndjson"
# Characters refused in a job's name and submission_id: C0/C1 controls (NUL, escape sequences,
# newlines) and the bidirectional controls that reorder what a terminal shows ("job-\u202egnp.exe"
# reads as "job-exe.png"); `dflash-trainer status` prints names as they are.
UNPRINTABLE = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNPRINTABLE_RE = re.compile(f"[{UNPRINTABLE}]")
PRINTABLE_PATTERN = f"^[^{UNPRINTABLE}]*$"
STREAM_RETRY_AFTER_SECONDS = 5
# a job state in any letter case, as GET /jobs?state= takes it
STATE_PATTERN = "^(" + "|".join("".join(f"[{c}{c.lower()}]" for c in state) for state in STATES) + ")$"


class DataDirInUse(RuntimeError):
    pass


class _DataDirLock:
    """One daemon per data directory: two would both run the queue's jobs."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # close-on-exec: a child process (inductor's compile workers, tokenizer workers) must not
        # inherit the lock and hold it after this daemon has exited
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
    """Everything the app owns for its lifetime. In a multi-host group, ranks other than 0 own only
    their engine and its probes: no job store, no job API."""

    def __init__(self, config: ServiceConfig, launch: Launch | None = None):
        self.config = config
        self.launch = launch
        self.follower = launch is not None and launch.rank > 0
        self.exit_code = 0  # what `serve` exits with (a rank that lost its group: 1, so it is restarted)
        self.lock = _DataDirLock(config.data_dir)
        self.store: JobStore | None = None
        self.host: EngineHost | None = None
        self.manager: JobManager | None = None
        self.metrics: ServiceMetrics | None = None
        self.hub: EventHub | None = None
        self._shutting_down = threading.Event()

    def start(self) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        if self.follower:
            self._start_follower()
            return
        self.store = JobStore(self.config.database_path)
        self.host = EngineHost(self.config, self.launch)
        self.manager = JobManager(self.config, self.store, self.host)
        self.metrics = ServiceMetrics(self.host, self.store, block_size=self.config.engine.block_size)
        self.manager.metrics = self.metrics
        self.hub = EventHub(
            self.store, _event_line, max_streams=self.config.max_event_streams, stopping=lambda: self.shutting_down
        )
        self.metrics.registry.register(_StreamCollector(self.hub))
        self.manager.start()
        self.host.start()
        log.info(
            "daemon started",
            extra={"fields": {"data_dir": str(self.config.data_dir), "database": str(self.config.database_path)}},
        )

    def _start_follower(self) -> None:
        assert self.launch is not None
        self.host = EngineHost(
            self.config, self.launch, on_group_end=self._group_ended, on_follower_step=self._observe_step
        )
        self.metrics = ServiceMetrics(self.host, None, block_size=self.config.engine.block_size)
        self.host.start()
        log.info(
            "daemon started (rank %d of %d: probes and metrics only; jobs come from rank 0)",
            self.launch.rank,
            self.launch.world,
            extra={"fields": {"data_dir": str(self.config.data_dir)}},
        )

    def _observe_step(self, stats) -> None:
        if self.metrics is not None:
            self.metrics.observe_device_steps(stats)

    def _group_ended(self, reason: str) -> None:
        """A rank other than 0 stopped following rank 0: exit (like SIGTERM), so that the launcher
        or the orchestrator starts it, and with it the group, again. Exit 0 only when rank 0 ended
        the group on purpose."""
        self.exit_code = 0 if reason == "rank 0 shut the group down" else 1
        log.warning("leaving: %s", reason)
        os.kill(os.getpid(), signal.SIGTERM)

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
                # and the data dir locked: a new daemon must not open the store while this process
                # still writes to it; the lock goes with the process
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
        "kind": job.spec.get("kind", "train"),
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


class _StreamCollector(Collector):
    """Followed event streams: how many are open, and what they cost the store."""

    def __init__(self, hub: EventHub):
        self.hub = hub

    def collect(self):
        yield GaugeMetricFamily(
            "dflash_event_streams",
            "Open followed event streams (GET /jobs/{id}/events?follow=true)",
            value=self.hub.open_streams,
        )
        yield GaugeMetricFamily(
            "dflash_event_streams_max",
            "Followed event streams served at most (max_event_streams)",
            value=self.hub.max_streams,
        )
        yield CounterMetricFamily(
            "dflash_event_stream_store_reads",
            "Store queries made for followed event streams (one poller per followed job, plus catch-ups)",
            value=self.hub.store_reads,
        )


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


def _event_line(event: EventRecord) -> str:
    return json.dumps(event_json(event)) + "\n"


def _error(status: int, detail: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers or None)


def _job_action(action: Callable[[str], JobRecord], job_id: str) -> JobRecord | JSONResponse:
    """Cancel or resume: the job, or the error answer (404 unknown, 409 its state does not allow
    it, 503 the job store cannot write: nothing was changed)."""
    try:
        return action(job_id)
    except JobNotFound:
        return _error(404, f"no job {job_id!r}")
    except (JobConflict, Unavailable) as e:
        return _error(409 if isinstance(e, JobConflict) else 503, str(e))


def _invalid_query(name: str, message: str) -> JSONResponse:
    return _error(422, f"invalid request: {name}: {message}", errors=[{"field": name, "message": message}])


def _invalid(errors: list[dict[str, str]]) -> JSONResponse:
    detail = "invalid job spec: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return _error(422, detail, errors=errors)


def _unprintable_fields(body: Any) -> list[dict[str, str]]:
    """name / submission_id holding characters a terminal would act on rather than show."""
    errors = []
    if isinstance(body, dict):
        for name in ("name", "submission_id"):
            value = body.get(name)
            if isinstance(value, str) and (found := _UNPRINTABLE_RE.search(value)):
                errors.append(
                    {
                        "field": name,
                        "message": f"contains U+{ord(found.group()):04X}, a control or bidirectional-override "
                        "character; use printable text",
                    }
                )
    return errors


class NDJSONStream(StreamingResponse):
    """Newline-delimited JSON; `on_close` runs when the response ends, however it ends (a client
    that disconnects included), so the stream's slot is always given back."""

    media_type = NDJSON

    def __init__(self, content, on_close=None):
        super().__init__(content, media_type=NDJSON)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()


# --------------------------------------------------------------------------- documented responses
def _doc(description: str, model: type = models.Error) -> dict[str, Any]:
    return {"model": model, "description": description}


NOT_FOUND = _doc("no job with this id")
# actions on one job (cancel, resume): the job as it is after the action, or why not
JOB_ACTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _doc("the job, already ended by the action (e.g. a queued job cancelled)", models.Job),
    202: _doc("the job; the action completes at its next step", models.Job),
    404: NOT_FOUND,
    409: _doc("the job's state does not allow the action"),
    503: _doc("the daemon cannot take the action now (shutting down, engine failed, store unavailable)"),
}


# --------------------------------------------------------------------------- app
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
    )
    app.state.daemon = daemon
    app.add_middleware(RequestGuard, config=config)
    if daemon.follower:
        assert launch is not None
        only = f"rank {launch.rank} of {launch.world} serves /healthz, /livez and /metrics; the job API is on rank 0"

        @app.middleware("http")
        async def _probes_only(request: Request, call_next):
            if request.url.path not in ("/healthz", "/livez", "/metrics"):
                return _error(404, only)
            return await call_next(request)

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
        # the exception's headers carry meaning (405's Allow lists the methods the path serves)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route that matched the path only; a path served
            # by several routes (GET and POST /jobs) serves the methods of all of them
            methods = set()
            for route in app.router.routes:
                if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
                    methods |= route.methods or set()
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return _error(exc.status_code, str(exc.detail), headers=headers)

    def _unauthorized(request: Request) -> JSONResponse | None:
        """The bearer token of a POST route (service.http_guard checks it before any route runs;
        a route that checks it again stays guarded if it is ever served without the guard)."""
        token = config.auth_token
        if token is None or token_matches(request.scope, [token]):
            return None
        return _error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")

    # ------------------------------------------------------------------ health
    # Probes are async: they read memory only and must answer even when every worker thread of
    # the pool is busy (e.g. submissions waiting for the engine during a cold start).
    @app.get(
        "/healthz",
        responses={
            200: _doc("every drafter is warm: jobs run", models.Health),
            503: _doc("starting, warming or failed (see status, phase and error)", models.Health),
        },
    )
    async def healthz() -> JSONResponse:
        assert daemon.host is not None  # set by daemon.start(), which the lifespan runs before any request
        body = daemon.host.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    @app.get(
        "/livez",
        responses={
            200: _doc("the process, its job worker and its engine threads are alive", models.Liveness),
            503: _doc("something died (see problems): restart the daemon", models.Liveness),
        },
    )
    async def livez() -> JSONResponse:
        assert daemon.host is not None  # set by daemon.start() (lifespan)
        assert daemon.manager is not None or daemon.follower
        problems = []
        if daemon.manager is not None and not daemon.manager.worker_alive and not daemon.shutting_down:
            problems.append("the job worker thread died")
        status = daemon.host.engine_status()
        if daemon.host.ready and status is not None and not status.threads_alive and not daemon.shutting_down:
            problems.append("an engine drafter thread died")
        if daemon.host.failed:
            problems.append(f"the engine failed to start: {daemon.host.error}")
        if (group_problem := daemon.host.group_problem) is not None and not daemon.shutting_down:
            # a group that lost a rank cannot train again in this process: restarting it (and with it
            # the group) is the cure, which is what a liveness probe's failure makes an orchestrator do
            problems.append(f"the multi-host group cannot train: {group_problem}; restart the group")
        body: dict[str, Any] = {
            "status": "alive" if not problems else "dead",
            "engine": daemon.host.status(),
            "job_worker_alive": daemon.manager.worker_alive if daemon.manager is not None else False,
            "engine_build_running": daemon.host.build_thread_alive,
        }
        if problems:
            body["problems"] = problems
        return JSONResponse(body, status_code=200 if not problems else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format (README, Metrics)"}},
    )
    def metrics() -> Response:
        assert daemon.metrics is not None  # set by daemon.start(), which the lifespan runs before any request
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ jobs
    @app.post(
        "/jobs",
        status_code=202,
        responses={
            200: _doc("the job already submitted with this submission_id and the same spec", models.Job),
            202: _doc("queued", models.Job),
            409: _doc(
                "the submission_id belongs to a job with another spec (`job` is that job), or the "
                "output_dir belongs to another job",
                models.SubmissionConflict,
            ),
            422: _doc("an invalid job spec; `errors` names every offending field", models.InvalidRequest),
            503: _doc("the engine failed to start, or the daemon is shutting down"),
        },
    )
    async def submit_job(request: Request) -> JSONResponse:
        if (denied := _unauthorized(request)) is not None:
            return denied
        raw = await request.body()  # at most MAX_BODY_BYTES: the guard read it
        try:
            body = json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _invalid([{"field": "body", "message": f"not valid JSON: {e}"}])
        except (RecursionError, ValueError) as e:  # absurdly nested or huge numbers
            return _invalid([{"field": "body", "message": f"not a usable JSON document ({type(e).__name__})"}])
        if body is None:
            return _invalid([{"field": "body", "message": "empty body; send the job spec as a JSON object"}])
        assert daemon.manager is not None  # set by daemon.start(), which the lifespan runs before any request
        unprintable = _unprintable_fields(body)
        try:
            spec = parse_spec(body)
            if unprintable:
                return _invalid(unprintable)
            job, created = await run_in_threadpool(daemon.manager.submit, spec)
        except InvalidSpec as e:
            return _invalid(
                unprintable + [err for err in e.errors if err["field"] not in {u["field"] for u in unprintable}]
            )
        except SpecError as e:
            return _invalid([{"field": e.field, "message": e.message}])
        except SubmissionConflict as e:
            return _error(409, str(e), job=job_json(e.existing))
        except JobConflict as e:
            return _error(409, str(e))
        except Unavailable as e:
            return _error(503, str(e))
        return JSONResponse(job_json(job), status_code=202 if created else 200)

    @app.get("/jobs", responses={200: _doc("the jobs, oldest first", models.JobList)})
    def list_jobs(
        state: str | None = Query(
            None,
            description="only jobs in this state (any letter case)",
            json_schema_extra={"pattern": STATE_PATTERN},
        ),
        limit: int = Query(1000, ge=1, le=100_000, description="the newest this many jobs"),
    ) -> JSONResponse:
        if state is not None and state.upper() not in STATES:
            return _invalid_query("state", f"{state!r} is not one of {', '.join(STATES)}")
        assert daemon.store is not None  # set by daemon.start(), which the lifespan runs before any request
        jobs = daemon.store.list_jobs(state=state.upper() if state else None, limit=limit)
        return JSONResponse({"jobs": [job_json(j) for j in jobs]})

    @app.get("/jobs/{job_id}", responses={200: _doc("the job, with its checkpoints", models.Job), 404: NOT_FOUND})
    def get_job(job_id: str) -> JSONResponse:
        assert daemon.store is not None  # set by daemon.start(), which the lifespan runs before any request
        job = daemon.store.get_job(job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return JSONResponse(job_json(job))

    @app.post("/jobs/{job_id}/cancel", responses=JOB_ACTION_RESPONSES)
    def cancel_job(request: Request, job_id: str) -> JSONResponse:
        if (denied := _unauthorized(request)) is not None:
            return denied
        assert daemon.manager is not None  # set by daemon.start(), which the lifespan runs before any request
        job = _job_action(daemon.manager.cancel, job_id)
        if isinstance(job, JSONResponse):
            return job
        # a queued job is STOPPED now (200); a running one stops at its next step (202)
        return JSONResponse(job_json(job), status_code=200 if job.terminal else 202)

    @app.post(
        "/jobs/{job_id}/resume",
        status_code=202,
        responses={
            202: _doc("the job, back in the queue: it resumes from its newest checkpoint", models.Job),
            404: NOT_FOUND,
            409: _doc("the job is not FAILED or STOPPED, or it has no checkpoint to resume from"),
            503: _doc("the job store cannot write, the engine failed to start, or the daemon is shutting down"),
        },
    )
    def resume_job(request: Request, job_id: str) -> JSONResponse:
        if (denied := _unauthorized(request)) is not None:
            return denied
        assert daemon.manager is not None  # set by daemon.start(), which the lifespan runs before any request
        job = _job_action(daemon.manager.resume, job_id)
        if isinstance(job, JSONResponse):
            return job
        # back in the queue (PENDING): it resumes from its newest checkpoint when its turn comes
        return JSONResponse(job_json(job), status_code=202)

    @app.get(
        "/jobs/{job_id}/events",
        status_code=200,
        response_class=NDJSONStream,
        responses={
            200: {
                "description": "the job's events, one JSON object (an Event) per line; with follow=true the "
                "stream stays open until the job ends",
                # a sequence of JSON documents: the schema of each (OpenAPI 3.2's itemSchema, as FastAPI
                # writes for its own JSON Lines streams)
                "content": {NDJSON: {"itemSchema": {"$ref": "#/components/schemas/Event"}}},
            },
            404: NOT_FOUND,
            429: {
                **_doc("max_event_streams followed streams are open already"),
                "headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
            },
        },
    )
    async def job_events(
        job_id: str,
        follow: bool = Query(False, description="keep streaming until the job ends"),
        after: int = Query(0, ge=0, le=2**63 - 1, description="only events with event_id greater than this"),
        kind: list[str] | None = Query(None, description="only these kinds (repeatable), e.g. step"),
    ) -> Response:
        store, hub = daemon.store, daemon.hub
        assert store is not None and hub is not None  # set by daemon.start(), which the lifespan runs first
        job = await run_in_threadpool(store.get_job, job_id, with_checkpoints=False)
        if job is None:
            return _error(404, f"no job {job_id!r}")

        if follow:
            # served by the job's shared feed (service.event_feed): a follower costs the store nothing
            # after its catch-up, and their number is bounded
            try:
                hub.open()
            except TooManyStreams as e:
                return _error(429, f"{e}; retry later", headers={"Retry-After": str(STREAM_RETRY_AFTER_SECONDS)})
            return NDJSONStream(hub.follow(job_id, after=after, kinds=kind), on_close=hub.close)

        async def lines():
            last = after
            while True:
                page = await run_in_threadpool(store.events, job_id, after=last, kinds=kind, limit=EVENT_PAGE)
                if page:  # a page in one write: a write per event costs the event loop many times more
                    last = page[-1].id
                    yield "".join(map(_event_line, page)).encode()
                if len(page) < EVENT_PAGE:
                    return

        return NDJSONStream(lines())

    app.openapi = lambda: _openapi(app, config)  # type: ignore[method-assign]
    return app


# --------------------------------------------------------------------------- OpenAPI
def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_response(description: str, schema: str = "Error") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _openapi(app: FastAPI, config: ServiceConfig) -> dict[str, Any]:
    """The served schema: the routes' own declarations, plus what FastAPI cannot see from them:
    the job spec as POST /jobs's body (the route parses it itself, to answer 401/413/415 before
    validating it), the responses of service.http_guard, which depend on the method and on this
    daemon's tokens, and our 422 body in place of FastAPI's."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})

    spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(spec_schema.pop("$defs", {}))
    for name in ("name", "submission_id"):  # what _unprintable_fields refuses
        for variant in spec_schema["properties"][name].get("anyOf", [spec_schema["properties"][name]]):
            if variant.get("type") == "string":
                variant["pattern"] = PRINTABLE_PATTERN
    # what JobSpec's own validator checks, where JSON Schema can say it: steps or epochs (one of
    # them), no dataset twice, betas in [0, 1)
    spec_schema["oneOf"] = [
        {"required": ["steps"], "properties": {"steps": {"type": "integer"}}},
        {"required": ["epochs"], "properties": {"epochs": {"type": "number"}}},
    ]
    spec_schema["properties"]["datasets"]["uniqueItems"] = True
    spec_schema["properties"]["adam_betas"]["items"].update(minimum=0, exclusiveMaximum=1)
    schemas["JobSpec"] = spec_schema
    # a body with "kind": "regenerate" is validated as this one instead (service.jobs.regenerate_spec)
    regenerate = RegenerateSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(regenerate.pop("$defs", {}))
    schemas["RegenerateSpec"] = regenerate
    for name, model in (("Error", models.Error), ("InvalidRequest", models.InvalidRequest), ("Event", models.Event)):
        if name not in schemas:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(model_schema.pop("$defs", {}))
            schemas[name] = model_schema

    submit = schema["paths"]["/jobs"]["post"]
    submit["requestBody"] = {
        "required": True,
        "description": 'the job spec (README, HTTP API), e.g. {"datasets": ["builtin://train"], "steps": 20}; '
        'a body with "kind": "regenerate" is a RegenerateSpec (README, Regeneration)',
        "content": {"application/json": {"schema": _ref("JobSpec")}},
    }

    guarded = False
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("default", None)
            for status, response in responses.items():  # errors are JSON, whatever the route streams
                content = response.get("content")
                if int(status) >= 400 and content and "application/json" not in content:
                    response["content"] = {"application/json": next(iter(content.values()))}
            if "422" in responses or operation.get("parameters") or operation.get("requestBody"):
                responses["422"] = _error_response(
                    responses.get("422", {}).get("description") or "an invalid request; `errors` names each field",
                    "InvalidRequest",
                )
            responses["400"] = _error_response("a malformed request (e.g. two Host headers)")
            responses["421"] = _error_response("the Host header names a server this daemon is not (allowed_hosts)")
            responses["431"] = _error_response("request line and headers over 16 KiB")
            mutating = method.upper() not in SAFE_METHODS
            if mutating:
                responses["403"] = _error_response("a browser page of another origin (allowed_origins)")
                responses["413"] = _error_response(f"a body of more than {MAX_BODY_BYTES} bytes")
                responses["415"] = _error_response("a body not sent as Content-Type: application/json")
                if path.startswith("/jobs/{job_id}/"):  # actions on a job
                    responses.setdefault("404", _error_response("no job with this id"))
                    responses.setdefault("409", _error_response("the job's state does not allow the action"))
            if "{job_id}" in path:
                responses.setdefault("404", _error_response("no job with this id"))
            if (mutating and config.auth_token is not None) or (
                not mutating and config.reads_protected and path not in UNGUARDED_READS
            ):
                guarded = True
                operation["security"] = [{"bearer": []}]
                responses["401"] = _error_response("no bearer token, or a wrong one")
            operation["responses"] = dict(sorted(responses.items()))
    if guarded:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, replaced above
        others = {key: value for key, value in schemas.items() if key != name}
        if f'"#/components/schemas/{name}"' not in json.dumps([schema["paths"], others]):
            schemas.pop(name, None)
    app.openapi_schema = schema
    return schema
