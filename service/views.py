"""The JSON the API answers with: a job, an event, an NDJSON stream of events. The shapes are
described for the OpenAPI document in service.api_models."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import StreamingResponse

from .jobs.store import REPORTED_PROGRESS, EventRecord, JobRecord

NDJSON = "application/x-ndjson"


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


def _data_progress(job: JobRecord) -> dict[str, Any] | None:
    """A job's data progress as reported; an estimate of the time left only while it runs (a
    stopped or ended job has none left to estimate)."""
    data = job.data
    if isinstance(data, dict) and data.get("eta_seconds") is not None and job.state != "RUNNING":
        return {**data, "eta_seconds": None}
    return data


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
            "data": _data_progress(job),
            "step": job.step,
            "total_steps": total,
            "fraction": round(job.step / total, 4) if total else None,
            **{name: getattr(job, name) for name in REPORTED_PROGRESS},
        },
        "error": job.error,
        "cancel_requested": job.cancel_requested,
        "resumes": job.resumes,
        "output_dir": job.output_dir,
        "spec": job.spec,
    }
    if job.published is not None:
        out["published"] = job.published
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


def _event_line(event: EventRecord) -> str:
    return json.dumps(event_json(event)) + "\n"


def event_line(event: EventRecord) -> str:
    return json.dumps(event_json(event)) + "\n"


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
