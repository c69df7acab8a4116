"""Job objectives through the real service: bad `loss` / `position_weights` / `recipe` are 422s
naming the field, a distillation job on a daemon without the teacher is refused naming `loss`, a
daemon warmed with `[engine] teacher = true` trains KL and D-PACE jobs to SUCCEEDED, and a DSpark
daemon trains its default mix and reports the confidence calibration."""

from __future__ import annotations

import json
import math

import pytest

BASE = {"datasets": ["builtin://train"], "steps": 3}


@pytest.fixture(scope="module")
def plain(daemon):
    return daemon  # the default configuration: the dflash recipe, no teacher


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"loss": "mse"}, "loss"),
        ({"loss": {"ce": 1.0, "lk": 0.5}}, "loss"),
        ({"loss": {"ce": -0.1, "tv": 1.0}}, "loss"),
        ({"loss": {"ce": 0.0, "tv": 0.0}}, "loss"),
        ({"loss": {}}, "loss"),
        ({"loss": 3}, "loss"),
        ({"loss": {"ce": 10**400}}, "loss"),  # an integer no float holds: a 422, not a 500
        ({"loss": {"ce": 1e308, "kl": 1e308}}, "loss"),
        ({"position_weights": "linear"}, "position_weights"),
        ({"dpace_alpha": 1.5}, "dpace_alpha"),
        ({"loss": "kl"}, "loss"),  # valid, but this daemon has no teacher
        ({"loss": {"ce": 0.1, "tv": 0.9}}, "loss"),
        ({"position_weights": "dpace"}, "position_weights"),
        ({"recipe": "dspark"}, "recipe"),  # this daemon warmed dflash
        ({"recipe": "medusa"}, "recipe"),
        ({"loss": {"ce": 1.0, "conf": 1.0}}, "loss"),  # conf: a dspark daemon only
        ({"loss": {"conf": 1.0}}, "loss"),  # nothing trains the logits
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


@pytest.mark.slow
def test_a_dspark_daemon_trains_and_calibrates(make_daemon):
    d = make_daemon(engine={"recipe": "dspark", "seq_len": 256, "num_anchors": 32})
    d.wait_ready(timeout=300)
    r = d.http.post("/jobs", json={**BASE, "position_weights": "dpace"})
    assert r.status_code == 422 and "position_weights" in [e["field"] for e in r.json()["errors"]], r.text
    r = d.http.post("/jobs", json={**BASE, "recipe": "dflash"})
    assert r.status_code == 422 and "recipe" in [e["field"] for e in r.json()["errors"]], r.text
    job = d.submit(
        {
            **BASE,
            "recipe": "dspark",
            "eval_prompts": "builtin://heldout",
            "eval_interval": 3,
            "eval_max_prompts": 2,
            "eval_max_new_tokens": 12,
        }
    )
    done = d.wait_terminal(job["id"], timeout=300)
    assert done["state"] == "SUCCEEDED", done
    evals = [e for e in d.events(job["id"]) if e["kind"] == "eval"]
    assert evals and "confidence_calibration" in json.dumps(evals[-1]), evals[-1]
