"""Nothing unbounded reaches the daemon: float settings that would make the weights non-finite,
deep nesting in a request body, in chat_template_kwargs or in dataset records, and a huge
newline-free file are refused as 422s or skipped lines naming file and line, never a 500 or an
RSS spike. One real daemon for the module."""

from __future__ import annotations

from pathlib import Path

import pytest


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


def _nested_object(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


@pytest.mark.parametrize("depth", [40, 300, 950, 5000])
def test_deeply_nested_chat_template_kwargs_are_a_422(daemon, depth):
    body = '{"datasets": ["builtin://train"], "steps": 1, "chat_template_kwargs": ' + _nested_object(depth) + "}"
    r = daemon.http.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json()["errors"]]
    assert fields == (["body"] if depth == 5000 else ["chat_template_kwargs"]), r.text


def _records(default_assets, n: int) -> list[str]:
    lines = default_assets.train.read_text().splitlines()
    return [lines[i % len(lines)] for i in range(n)]


def _deep_record(depth: int) -> str:
    return '{"messages": [{"role": "user", "content": "hi", "extra": ' + "[" * depth + "]" * depth + "}]}"


@pytest.mark.parametrize("depth", [300, 950, 5000])
def test_deeply_nested_records_name_file_and_line(daemon, default_assets, depth):
    lines = _records(default_assets, 60)
    lines[2] = _deep_record(depth)  # among the first records: refused at submission
    early = daemon.data_dir / f"deep-early-{depth}.jsonl"
    early.write_text("\n".join(lines) + "\n")
    r = daemon.http.post("/jobs", json={"datasets": [str(early)], "steps": 1})
    assert r.status_code == 422, r.text
    assert ".jsonl:3:" in r.text and "nested deeper" in r.text, r.text
    lines = _records(default_assets, 60)
    lines[49] = _deep_record(depth)  # past them: the job reads it
    late = daemon.data_dir / f"deep-late-{depth}.jsonl"
    late.write_text("\n".join(lines) + "\n")
    failed = daemon.submit({"datasets": [str(late)], "steps": 1})
    ended = daemon.wait_terminal(failed["id"])
    assert ended["state"] == "FAILED" and ".jsonl:50:" in ended["error"] and "nested deeper" in ended["error"], ended
    skipped = daemon.submit({"datasets": [str(late)], "steps": 1, "skip_bad_lines": True})
    ended = daemon.wait_terminal(skipped["id"])
    assert ended["state"] == "SUCCEEDED", ended
    (event,) = [e for e in daemon.events(skipped["id"]) if e["kind"] == "skipped_lines"]
    assert event["count"] == 1 and ".jsonl:50:" in event["first"][0], event


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.parametrize("skip_bad_lines", [False, True])
def test_a_1gb_newline_free_file_is_refused_without_an_rss_spike(daemon, skip_bad_lines):
    sparse = daemon.data_dir / "sparse.jsonl"
    if not sparse.exists():
        with sparse.open("wb") as f:
            f.truncate(1 << 30)  # sparse: no disk used, 1 GiB of zero bytes and no newline
    pid = daemon.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _rss_kib(pid, "VmRSS")
    r = daemon.http.post("/jobs", json={"datasets": [str(sparse)], "steps": 1, "skip_bad_lines": skip_bad_lines})
    assert r.status_code == 422, r.text
    assert ".jsonl:1:" in r.text and "longer than 16 MiB" in r.text, r.text
    growth_mib = (_rss_kib(pid, "VmHWM") - before) / 1024
    assert growth_mib < 64, growth_mib


@pytest.mark.parametrize(
    "body, key",
    [
        ('{"kind": "train", "datasets": ["builtin://train"], "steps": 1, "kind": "regenerate"}', "kind"),
        ('{"datasets": ["builtin://train"], "steps": 1, "loss": {"ce": 1, "ce": 0.5}}', "ce"),
    ],
)
def test_a_key_given_twice_is_a_422_naming_it(daemon, body, key):
    r = daemon.http.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == [key], r.text


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "latin-1"])
def test_a_body_not_in_utf8_is_refused(daemon, encoding):
    body = '{"datasets": ["builtin://train"], "steps": 1, "name": "caf\u00e9"}'.encode(encoding)
    r = daemon.http.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["errors"][0]["field"] == "body" and "UTF-8" in r.text, r.text
