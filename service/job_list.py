"""GET /jobs rendered without reading and encoding again what cannot have changed.

A job that ended stays as it ended until it is resumed (which changes its state), so its entry
in the list is kept as the JSON bytes it was rendered to, under the version of its row the store
gives (store_lists.VERSION_COLUMNS); only the jobs that have not ended, and ended jobs whose
version moved, are read and encoded again. Without this, a list of a thousand jobs costs tens of
milliseconds of the interpreter per request, which a few polling clients turn into a training
step rate lost and every route answering late.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from .jobs.store import TERMINAL, JobStore
from .views import job_json

MAX_CACHED = 20_000  # ended jobs' entries kept (about a kilobyte each)


def encode(value: Any) -> bytes:
    """JSON as the API's responses encode it (starlette's JSONResponse)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


class JobListCache:
    def __init__(self, store: JobStore):
        self.store = store
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[tuple[Any, ...], bytes]] = {}

    def render(self, state: str | None, limit: int) -> bytes:
        """The body of GET /jobs: {"jobs": [...]}, oldest first."""
        versions = self.store.list_versions(state=state, limit=limit)
        with self._lock:
            known = {job_id: entry for job_id, _, _ in versions if (entry := self._entries.get(job_id)) is not None}
        stale = [
            job_id
            for job_id, job_state, version in versions
            if job_state not in TERMINAL or job_id not in known or known[job_id][0] != version
        ]
        fresh = {job.id: job for job in self.store.jobs_by_id(stale)}
        parts = []
        for job_id, job_state, version in versions:
            job = fresh.get(job_id)
            if job is None:
                if job_id in known:
                    parts.append(known[job_id][1])
                continue
            body = encode(job_json(job))
            parts.append(body)
            if job.state in TERMINAL and job.state == job_state:  # as the version read it
                self._keep(job_id, version, body)
        return b'{"jobs":[' + b",".join(parts) + b"]}"

    def _keep(self, job_id: str, version: tuple[Any, ...], body: bytes) -> None:
        with self._lock:
            self._entries.pop(job_id, None)
            self._entries[job_id] = (version, body)
            while len(self._entries) > MAX_CACHED:  # the least recently rendered go first
                self._entries.pop(next(iter(self._entries)))
