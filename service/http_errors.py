"""How the service's errors become answers: one exception handler per kind of failure, every body
{"detail": ...} (plus `errors`, one {field, message} per problem, on a 422; `job` on a submission
conflict). Routes raise; they never build an error answer themselves."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from .event_feed import TooManyStreams
from .jobs.by_kind import field_errors
from .jobs.errors import JobConflict, JobNotFound, Unavailable
from .jobs.records import BufferFull
from .jobs.schemas import SpecError
from .jobs.store import SubmissionConflict
from .views import job_json

STREAM_RETRY_AFTER_SECONDS = 5
_LOCATIONS = ("query", "path", "body", "header")


def error(status: int, detail: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers or None)


async def invalid(request: Request, exc: Exception) -> JSONResponse:
    """422 naming every offending field: a SpecError raised anywhere, or FastAPI's validation of a
    route's parameters and body (which carries the SpecErrors our validators raised)."""
    if isinstance(exc, SpecError):
        errors, what = exc.errors, exc.subject
    else:
        assert isinstance(exc, RequestValidationError)
        raw = list(exc.errors())
        located = [{**e, "loc": tuple(e.get("loc", ()))[1:]} if _located(e) else e for e in raw]
        errors = field_errors(located)
        what = "job spec" if any(tuple(e.get("loc", ()))[:1] == ("body",) for e in raw) else "request"
    detail = f"invalid {what}: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return error(422, detail, errors=errors)


def _located(e: Mapping[str, Any]) -> bool:
    loc = tuple(e.get("loc", ()))
    return bool(loc) and loc[0] in _LOCATIONS


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    # the exception's headers carry meaning (405's Allow lists the methods the path serves)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names the methods of the first route that matched the path only; a path served
        # by several routes (GET and POST /jobs) serves the methods of all of them
        methods: set[str] = set()
        for route in request.app.state.routes:
            if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
                methods |= route.methods or set()
        if methods:
            headers["Allow"] = ", ".join(sorted(methods))
    return error(exc.status_code, str(exc.detail), headers=headers)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return error(404, f"no job {exc.args[0]!r}")


async def _submission_conflict(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SubmissionConflict)
    return error(409, str(exc), job=job_json(exc.existing))


async def _conflict(request: Request, exc: Exception) -> JSONResponse:
    return error(409, str(exc))


async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    return error(503, str(exc))


async def _buffer_full(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BufferFull)
    return error(429, str(exc), headers={"Retry-After": str(exc.retry_after)})


async def _too_many_streams(request: Request, exc: Exception) -> JSONResponse:
    return error(429, f"{exc}; retry later", headers={"Retry-After": str(STREAM_RETRY_AFTER_SECONDS)})


HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    RequestValidationError: invalid,
    SpecError: invalid,
    StarletteHTTPException: _http_error,
    JobNotFound: _not_found,
    SubmissionConflict: _submission_conflict,
    JobConflict: _conflict,
    Unavailable: _unavailable,
    TooManyStreams: _too_many_streams,
    BufferFull: _buffer_full,
}
