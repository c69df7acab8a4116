"""A job route asked before the daemon has a job manager answers 503 with the service's error body
(the RunningManager dependency), never an internal error."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.http_errors import HANDLERS
from service.routes import jobs, records


def test_a_job_route_without_a_manager_answers_503():
    app = FastAPI(exception_handlers=HANDLERS)
    app.include_router(jobs.router)
    app.include_router(records.router)
    app.state.daemon = SimpleNamespace(manager=None)
    client = TestClient(app)
    for method, path in [
        ("post", "/jobs/nope/cancel"),
        ("post", "/jobs/nope/resume"),
        ("get", "/jobs/nope"),
        ("post", "/jobs/nope/records"),
    ]:
        r = getattr(client, method)(path)
        assert r.status_code == 503, (method, path, r.text)
        assert set(r.json()) == {"detail"} and "job manager" in r.json()["detail"]
