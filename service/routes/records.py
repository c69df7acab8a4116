"""The ingest route of continual jobs: POST /jobs/{id}/records, one record per line (NDJSON).
The body is bounded by the request guard (413 over MAX_BODY_BYTES); service.jobs.records
validates, bounds and persists it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from .. import api_models as models
from ..http_guard import MAX_BODY_BYTES
from . import RunningManager, doc

router = APIRouter(prefix="/jobs")


@router.post(
    "/{job_id}/records",
    status_code=202,
    responses={
        202: {"description": 'accepted and durable: {"accepted": n}'},
        404: doc("no job with this id"),
        409: doc("the job is not a RUNNING continual job"),
        413: doc(f"a body of more than {MAX_BODY_BYTES} bytes"),
        422: doc(
            "a line that is not a conversation (or a prompt, for a job that regenerates), `errors` naming it; "
            "or more lines than the job's max_pending_records",
            models.InvalidRequest,
        ),
        429: {
            **doc("the job holds max_pending_records records not yet trained"),
            "headers": {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
        },
    },
    openapi_extra={
        "requestBody": {
            "description": "NDJSON (Content-Type application/x-ndjson, or application/json for one record), one "
            'record per line: {"messages": [...]} (a conversation) or {"prompt": ...}',
            # documented as its lines' type: one record is a valid body of either media type
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    },
)
async def post_records(job_id: str, request: Request, manager: RunningManager) -> JSONResponse:
    body = await request.body()  # read (bounded) by the request guard already
    accepted = await run_in_threadpool(manager.ingest.accept, job_id, body)
    return JSONResponse({"accepted": accepted}, status_code=202)
