"""Startup is observable (503 starting/warming, then 200) while /livez answers throughout; jobs
submitted while warming wait and then run; the bearer token guards POST endpoints."""

from __future__ import annotations

import time

import pytest

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def warming_daemon(make_daemon):
    # a 1 s pause after each warm-up phase (the daemon's test hook; the build is real) makes warming
    # observable: each phase outlasts many rounds of the test's 0.1 s polls
    return make_daemon(auth_token=TOKEN, warmup_pause=1.0)


@pytest.mark.slow  # a daemon held in each warm-up phase for a while
def test_healthz_503_while_warming_then_200_and_livez_throughout(warming_daemon):
    d = warming_daemon
    seen: list[tuple[int, str, str]] = []
    queued = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        live = d.http.get("/livez")
        assert live.status_code == 200, live.text
        r = d.http.get("/healthz")
        body = r.json()
        seen.append((r.status_code, body["status"], body["phase"]))
        if r.status_code == 200:
            break
        assert r.status_code == 503
        assert body["status"] in ("starting", "warming"), body
        assert body["drafters_total"] == 1 and 0 <= body["drafters_ready"] <= 1
        assert isinstance(body["elapsed_seconds"], float)
        if queued is None and body["status"] == "warming":  # jobs may be submitted while warming
            spec = {"datasets": ["builtin://train"], "steps": 3, "checkpoint_interval": 3}
            assert d.http.post("/jobs", json=spec).status_code == 401  # the guard answers in any phase
            r = d.http.post("/jobs", json=spec, headers=AUTH)
            assert r.status_code == 202, r.text
            queued = r.json()
            assert d.http.get(f"/jobs/{queued['id']}").json()["state"] == "PENDING"
        time.sleep(0.1)
    statuses = [s for _, s, _ in seen]
    assert "warming" in statuses, seen
    assert seen[-1][0] == 200 and seen[-1][1] == "ready", seen
    ready = d.http.get("/healthz").json()
    assert ready["drafters_ready"] == ready["drafters_total"] == 1
    assert ready["compiles"]["runtime"] == 0
    assert ready["checkpoint_buffers"] == "none"  # a CPU engine's state is host memory: nothing to pin
    assert {"warming_target", "warming_drafters"} <= {p for _, _, p in seen}, seen

    assert queued is not None
    assert d.wait_terminal(queued["id"])["state"] == "SUCCEEDED"
    assert d.http.get("/livez").status_code == 200


def test_post_without_token_is_401(warming_daemon):
    d = warming_daemon  # warm by now, or warming if this test runs alone: the guard answers in any phase
    spec = {"datasets": ["builtin://train"], "steps": 2}
    r = d.http.post("/jobs", json=spec)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert "bearer" in r.json()["detail"].lower()
    assert d.http.post("/jobs", json=spec, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert d.http.post("/jobs", json=spec, headers={"Authorization": TOKEN}).status_code == 401  # scheme missing
    # validation does not run before authentication: an invalid spec without a token is still 401
    assert d.http.post("/jobs", json={"bogus": 1}).status_code == 401

    ok = d.http.post("/jobs", json=spec, headers=AUTH)
    assert ok.status_code == 202
    job_id = ok.json()["id"]
    assert d.http.post(f"/jobs/{job_id}/cancel").status_code == 401
    # reads need no token
    assert d.http.get(f"/jobs/{job_id}").status_code == 200
    assert d.http.get("/jobs").status_code == 200
    assert d.http.get("/metrics").status_code == 200
    assert d.http.get("/healthz").status_code in (200, 503)
    d.wait_terminal(job_id)


@pytest.mark.slow  # starts a daemon of its own
def test_engine_that_cannot_start_reports_failed(make_daemon, tmp_path):
    broken = tmp_path / "no-such-model"  # a model dir whose config no library understands
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "not-a-real-architecture"}')
    d = make_daemon(engine={"target_path": str(broken)})
    deadline = time.monotonic() + 60
    while (body := d.http.get("/healthz").json())["status"] != "failed":
        assert body["status"] in ("starting", "warming")
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    r = d.http.get("/healthz")
    assert r.status_code == 503
    assert r.json()["error"] and r.json()["phase"].startswith("failed during")
    assert d.http.get("/livez").status_code == 503  # a supervisor should restart (or page), not wait forever
    r = d.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 2})
    assert r.status_code == 503 and "engine failed" in r.json()["detail"]
    metrics = d.http.get("/metrics")
    assert metrics.status_code == 200 and "dflash_ready 0.0" in metrics.text
