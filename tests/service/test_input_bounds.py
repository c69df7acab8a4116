"""Nothing unbounded reaches the daemon: float settings that would make the weights non-finite,
deep nesting in a request body, in chat_template_kwargs or in dataset records, and a huge
newline-free file are refused as 422s or skipped lines naming file and line, never a 500 or an
RSS spike. One real daemon for the module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def daemon(make_daemon):
    d = make_daemon()
    d.wait_ready()
    return d


def _refused(daemon, spec, field):
    r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, **spec})
    assert r.status_code == 422, r.text
    assert any(e["field"] == field for e in r.json()["errors"]), r.text


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"loss_gamma": 1e-300}, "loss_gamma"),
        ({"loss_gamma": 0.001}, "loss_gamma"),
        ({"learning_rate": 5.0}, "learning_rate"),
        ({"weight_decay": 2.0}, "weight_decay"),
    ],
)
def test_float_settings_that_break_training_are_refused(daemon, spec, field):
    _refused(daemon, spec, field)
