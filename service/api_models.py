"""The shapes of the daemon's responses, for its OpenAPI document (GET /openapi.json).

The routes build their JSON by hand (service.views.job_json and friends); these models describe that
JSON so that the served schema says what the daemon returns. tests/service/test_openapi.py checks
the two against each other with schemathesis on a real daemon. Extra keys are allowed, so a field
added to a response does not make older clients' schemas wrong.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from dflash_core.kinds import DEFAULT_KIND, KINDS

from .jobs.store import REPORTED_PROGRESS, STATES, JobRecord

JobState = Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"]
assert set(get_args(JobState)) == set(STATES)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Error(_Open):
    detail: str = Field(description="what went wrong, for a person")


class FieldError(_Open):
    field: str = Field(description="the offending field, e.g. datasets[0], or body / a query parameter")
    message: str


class InvalidRequest(Error):
    """422: every problem of the request, one per field."""

    errors: list[FieldError]


class Checkpoint(_Open):
    step: int
    path: str
    time: datetime | None


class _ProgressHead(_Open):
    # Progress's own fields; the rest are the job record's, as they are
    phase: str | None = Field(description="preparing_data, training or (a regeneration) generating while RUNNING")
    data: dict[str, Any] | None = Field(
        description="the last data preparation progress; a regeneration's progress (rows_done, rows_total, "
        "prompts_done, prompts_total, tokens_generated, tokens_per_second, eta_seconds)"
    )
    step: int
    total_steps: int | None
    fraction: float | None


_RECORD_TYPES = get_type_hints(JobRecord)
_REPORTED_FIELDS: dict[str, Any] = {name: (_RECORD_TYPES[name], ...) for name in REPORTED_PROGRESS}
Progress = create_model("Progress", __base__=_ProgressHead, **_REPORTED_FIELDS)


class Job(_Open):
    id: str
    name: str | None
    submission_id: str | None
    # every kind of the kinds table, so that a kind added there is documented without an edit here
    kind: str = Field(DEFAULT_KIND, json_schema_extra={"enum": [k.name for k in KINDS]})
    state: JobState
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    queue_position: int | None = Field(description="jobs ahead of this one while PENDING")
    progress: Progress
    error: str | None
    cancel_requested: bool
    resumes: int
    output_dir: str
    spec: dict[str, Any] = Field(description="the job spec as accepted, defaults filled in")
    checkpoints: list[Checkpoint] | None = Field(None, description="GET /jobs/{job_id} only")


class SubmissionConflict(Error):
    job: Job | None = Field(None, description="the job that holds this submission_id")


class JobList(_Open):
    jobs: list[Job]


class Health(_Open):
    status: Literal["starting", "warming", "ready", "failed"]
    phase: str
    drafters_ready: int
    drafters_total: int
    elapsed_seconds: float
    error: str | None = None
    compiles: dict[str, Any] | None = None
    warmup_seconds: list[dict[str, Any]] | None = None
    checkpoint_buffers: Literal["none", "pinning", "pinned", "failed"] | None = Field(
        None,
        description="ready: the checkpoint snapshot's pinned host buffers, allocated in the background from ready "
        "on (a checkpoint due before they are pinned waits for them; failed: the first checkpoint pins what is missing)",
    )
    rank: int | None = Field(None, description="multi-host: this process's rank")
    ranks_ready: int | None = Field(None, description="multi-host, rank 0: ranks warm and answering")
    ranks_total: int | None = Field(None, description="multi-host: ranks in the group")


class Liveness(_Open):
    status: Literal["alive", "dead"]
    engine: str
    job_worker_alive: bool
    engine_build_running: bool
    problems: list[str] | None = None


class Event(_Open):
    """One line of the NDJSON event stream; the other keys depend on `kind`."""

    event_id: int
    job_id: str
    time: float
    kind: str = Field(description="step, checkpoint, eval, state, resumed, preparing_data, data, ...")
    step: int | None
