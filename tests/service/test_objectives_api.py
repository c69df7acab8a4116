"""Job objectives through the real service: bad `loss` / `position_weights` are 422s naming the
field, a distillation job on a daemon without the teacher is refused naming `loss`, and a daemon
warmed with `[engine] teacher = true` trains KL and D-PACE jobs to SUCCEEDED."""

from __future__ import annotations

import math

import pytest

BASE = {"datasets": ["builtin://train"], "steps": 3}


@pytest.fixture(scope="module")
def plain(make_daemon):
    d = make_daemon()
    d.wait_ready()
    return d


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"loss": "mse"}, "loss"),
        ({"loss": {"ce": 1.0, "lk": 0.5}}, "loss"),
        ({"loss": {"ce": -0.1, "tv": 1.0}}, "loss"),
        ({"loss": {"ce": 0.0, "tv": 0.0}}, "loss"),
        ({"loss": {}}, "loss"),
        ({"loss": 3}, "loss"),
        ({"position_weights": "linear"}, "position_weights"),
        ({"dpace_alpha": 1.5}, "dpace_alpha"),
        ({"loss": "kl"}, "loss"),  # valid, but this daemon has no teacher
        ({"loss": {"ce": 0.1, "tv": 0.9}}, "loss"),
        ({"position_weights": "dpace"}, "position_weights"),
    ],
)
def test_bad_objectives_are_422_naming_the_field(plain, patch, field):
    r = plain.http.post("/jobs", json={**BASE, **patch})
    assert r.status_code == 422, r.text
    assert field in [e["field"] for e in r.json()["errors"]], r.text


@pytest.mark.slow
def test_a_teacher_daemon_trains_kl_and_dpace_jobs(make_daemon):
    d = make_daemon(engine={"teacher": True})
    d.wait_ready(timeout=300)
    for patch in ({"loss": "kl"}, {"loss": {"ce": 0.1, "tv": 0.9}, "position_weights": "dpace"}):
        job = d.submit({**BASE, **patch})
        done = d.wait_terminal(job["id"], timeout=300)
        assert done["state"] == "SUCCEEDED", done
        steps = [e for e in d.events(job["id"]) if e["kind"] == "step"]
        assert len(steps) == 3 and all(math.isfinite(e["loss"]) for e in steps), steps[-1]
