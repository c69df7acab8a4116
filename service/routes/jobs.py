"""The job API: submit (POST /jobs), list, read, cancel, resume, and the event stream.

POST /jobs takes a typed body, as FastAPI documents it: the JSON is decoded by the daemon's own
rules first (`SpecRoute`: what is not a usable JSON document is a 422 naming `body`), then
`parse_spec` validates it as the spec of its kind. Failures are raised, not answered here:
service.http_errors maps them (SpecError 422, JobNotFound 404, JobConflict 409, Unavailable 503).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, PlainValidator
from starlette.concurrency import run_in_threadpool

from dflash_core.kinds import DEFAULT_KIND, KINDS

from .. import api_models as models
from ..event_feed import EVENT_PAGE
from ..jobs.by_kind import parse_spec
from ..jobs.errors import JobNotFound
from ..jobs.schemas import JobSpec, SpecError
from ..jobs.store import STATES
from ..views import NDJSON, NDJSONStream, event_line, job_json
from . import RunningDaemon, RunningManager, doc

# a job state in any letter case, as GET /jobs?state= takes it
STATE_PATTERN = "^(" + "|".join("".join(f"[{c}{c.lower()}]" for c in state) for state in STATES) + ")$"
NOT_FOUND = doc("no job with this id")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: with a key twice, which value counts is the parser's
    choice, and the request would not mean what its reader sees."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SpecError(key, f"the key {key!r} appears more than once in one JSON object")
        out[key] = value
    return out


def decode_json_body(raw: bytes) -> Any:
    """The body as JSON, or a SpecError naming `body` (at most MAX_BODY_BYTES: the guard read it).
    JSON is UTF-8 (RFC 8259): another encoding is refused rather than guessed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError("body", f"not UTF-8 text ({e.reason} at byte {e.start}); send JSON encoded as UTF-8") from None
    try:
        body = json.loads(text, object_pairs_hook=_unique_keys) if text.strip() else None
    except json.JSONDecodeError as e:
        raise SpecError("body", f"not valid JSON: {e}") from None
    except SpecError:  # a key given twice (a ValueError too)
        raise
    except (RecursionError, ValueError) as e:  # absurdly nested or huge numbers
        raise SpecError("body", f"not a usable JSON document ({type(e).__name__})") from None
    if body is None:
        raise SpecError("body", "empty body; send the job spec as a JSON object")
    return body


class SpecRoute(APIRoute):
    """A route whose JSON body is decoded by decode_json_body before FastAPI reads it: FastAPI
    answers some undecodable bodies (too deeply nested) with a 400 of its own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def decode_first(request: Request) -> Response:
            decode_json_body(await request.body())
            return await handler(request)

        return decode_first


OTHER_KINDS = [k for k in KINDS if k.name != DEFAULT_KIND]  # each a schema component of its own (service.openapi)

# The spec of any kind (parse_spec returns its kind's model); typed and documented as JobSpec, the
# default kind (each other kind's spec is a component of its own, service.openapi)
SubmittedSpec = Annotated[
    JobSpec,
    PlainValidator(parse_spec, json_schema_input_type=JobSpec),
    Body(),
]


def _job_state(value: str | None) -> str | None:
    if value is not None and value.upper() not in STATES:
        raise SpecError("state", f"{value!r} is not one of {', '.join(STATES)}")
    return value.upper() if value else None


router = APIRouter(
    prefix="/jobs",
    route_class=SpecRoute,
    responses={422: doc("an invalid request; `errors` names each field", models.InvalidRequest)},
)


@router.post(
    "",
    status_code=202,
    responses={
        200: doc("the job already submitted with this submission_id and the same spec", models.Job),
        202: doc("queued", models.Job),
        409: doc(
            "the submission_id belongs to a job with another spec (`job` is that job), or the "
            "output_dir belongs to another job",
            models.SubmissionConflict,
        ),
        422: doc("an invalid job spec; `errors` names every offending field", models.InvalidRequest),
        503: doc("the engine failed to start, or the daemon is shutting down"),
    },
    openapi_extra={
        "requestBody": {
            "description": 'the job spec (README, HTTP API), e.g. {"datasets": ["builtin://train"], "steps": 20}; '
            + "; ".join(f'a body with "kind": "{k.name}" is a {k.spec.rpartition(":")[2]}' for k in OTHER_KINDS)
            + " (README, Regeneration and Continual jobs)"
        }
    },
)
async def submit_job(spec: SubmittedSpec, manager: RunningManager) -> JSONResponse:
    job, created = await run_in_threadpool(manager.submit, spec)
    return JSONResponse(job_json(job), status_code=202 if created else 200)


@router.get("", responses={200: doc("the jobs, oldest first", models.JobList)})
def list_jobs(
    daemon: RunningDaemon,
    state: Annotated[
        str | None,
        Query(description="only jobs in this state (any letter case)", json_schema_extra={"pattern": STATE_PATTERN}),
        AfterValidator(_job_state),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100_000, description="the newest this many jobs")] = 1000,
) -> Response:
    assert daemon.job_list is not None  # set by Daemon.start(), which the lifespan runs before any request
    return Response(daemon.job_list.render(state, limit), media_type="application/json")


@router.get("/{job_id}", responses={200: doc("the job, with its checkpoints", models.Job), 404: NOT_FOUND})
def get_job(job_id: str, manager: RunningManager) -> JSONResponse:
    job = manager.store.get_job(job_id)
    if job is None:
        raise JobNotFound(job_id)
    return JSONResponse(job_json(job))


# actions on one job (cancel, resume): the job as it is after the action, or why not
JOB_ACTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: doc("the job, already ended by the action (e.g. a queued job cancelled)", models.Job),
    202: doc("the job; the action completes at its next step", models.Job),
    404: NOT_FOUND,
    409: doc("the job's state does not allow the action"),
    503: doc("the daemon cannot take the action now (shutting down, engine failed, store unavailable)"),
}


@router.post("/{job_id}/cancel", responses=JOB_ACTION_RESPONSES)
def cancel_job(job_id: str, manager: RunningManager) -> JSONResponse:
    job = manager.cancel(job_id)
    # a queued job is STOPPED now (200); a running one stops at its next step (202)
    return JSONResponse(job_json(job), status_code=200 if job.terminal else 202)


@router.post(
    "/{job_id}/resume",
    status_code=202,
    responses={
        202: doc("the job, back in the queue: it resumes from its newest checkpoint", models.Job),
        404: NOT_FOUND,
        409: doc("the job is not FAILED or STOPPED, or it has no checkpoint to resume from"),
        503: doc("the job store cannot write, the engine failed to start, or the daemon is shutting down"),
    },
)
def resume_job(job_id: str, manager: RunningManager) -> JSONResponse:
    # back in the queue (PENDING): it resumes from its newest checkpoint when its turn comes
    return JSONResponse(job_json(manager.resume(job_id)), status_code=202)


@router.get(
    "/{job_id}/events",
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
            **doc("max_event_streams followed streams are open already"),
            "headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
        },
    },
)
async def job_events(
    job_id: str,
    daemon: RunningDaemon,
    follow: Annotated[bool, Query(description="keep streaming until the job ends")] = False,
    after: Annotated[int, Query(ge=0, le=2**63 - 1, description="only events with event_id greater than this")] = 0,
    kind: Annotated[list[str] | None, Query(description="only these kinds (repeatable), e.g. step")] = None,
) -> Response:
    store, hub = daemon.store, daemon.hub
    assert store is not None and hub is not None  # set by Daemon.start(), which the lifespan runs first
    if await run_in_threadpool(store.get_job, job_id, with_checkpoints=False) is None:
        raise JobNotFound(job_id)
    if follow:
        # served by the job's shared feed (service.event_feed): a follower costs the store nothing
        # after its catch-up, and their number is bounded (TooManyStreams: 429)
        hub.open()
        return NDJSONStream(hub.follow(job_id, after=after, kinds=kind), on_close=hub.close)

    async def lines():
        last = after
        while True:
            page = await run_in_threadpool(store.events, job_id, after=last, kinds=kind, limit=EVENT_PAGE)
            if page:  # a page in one write: a write per event costs the event loop many times more
                last = page[-1].id
                yield "".join(map(event_line, page)).encode()
            if len(page) < EVENT_PAGE:
                return

    return NDJSONStream(lines())
