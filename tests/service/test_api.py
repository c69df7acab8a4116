"""The HTTP contract (docs/design.md) against one real daemon: jobs, validation, cancel,
idempotency, events and /metrics after a job."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_core.defaults import ASSETS_VERSION
from tests.metric_names import CONTRACT_METRICS, PER_JOB_GAUGES
from tests.service.harness import step_numbers

SHORT_JOB = {
    "datasets": ["builtin://train"],
    "steps": 20,
    "checkpoint_interval": 10,
    "name": "short",
    "eval_prompts": "builtin://heldout",
    "eval_interval": 10,
    "eval_max_prompts": 2,
    "eval_max_new_tokens": 16,
}


@pytest.fixture(scope="module")
def finished_job(daemon):
    """A job followed from submission to SUCCEEDED; returns (job, events streamed with follow)."""
    submitted = daemon.submit(SHORT_JOB)
    assert submitted["state"] == "PENDING"
    assert submitted["progress"]["step"] == 0
    lines = []
    with daemon.http.stream("GET", f"/jobs/{submitted['id']}/events", params={"follow": "true"}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        for line in r.iter_lines():
            if line.strip():
                lines.append(json.loads(line))
    return daemon.job(submitted["id"]), lines


def test_job_runs_pending_running_succeeded_and_streams_events(finished_job):
    job, events = finished_job
    assert job["state"] == "SUCCEEDED"
    states = [e["state"] for e in events if e["kind"] == "state"]
    assert states == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert events[-1]["kind"] == "state" and events[-1]["state"] == "SUCCEEDED"  # follow ended with the job
    assert step_numbers(events) == list(range(1, 21))
    step = next(e for e in events if e["kind"] == "step")
    for key in ("loss", "tokens_per_second", "position_accuracy", "step_seconds", "total_steps", "learning_rate"):
        assert key in step
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [10, 20]
    assert [e["step"] for e in events if e["kind"] == "eval"] == [10, 20]

    progress = job["progress"]
    assert progress["step"] == progress["total_steps"] == 20
    assert progress["fraction"] == 1.0
    assert math.isfinite(progress["loss"]) and progress["loss"] > 0
    assert progress["tokens_per_second"] > 0
    assert progress["eval_acceptance_length"] >= 1.0
    assert progress["last_checkpoint"].endswith("step-00000020")
    assert [c["step"] for c in job["checkpoints"]] == [10, 20]
    assert job["error"] is None and job["finished_at"] is not None


def test_checkpoint_of_finished_job_loads(finished_job, daemon):
    from dflash_core.checkpoint import load_drafter, read_metadata

    job, _ = finished_job
    path = Path(job["progress"]["last_checkpoint"])
    assert path.is_relative_to(daemon.data_dir)
    drafter = load_drafter(path)
    assert drafter.config.block_size == 8
    assert read_metadata(path)["step"] == 20
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]


def test_events_without_follow_and_kind_filter(finished_job, daemon):
    job, streamed = finished_job
    events = daemon.events(job["id"])
    assert [e["event_id"] for e in events] == [e["event_id"] for e in streamed]
    steps_only = daemon.events(job["id"], kind="step")
    assert {e["kind"] for e in steps_only} == {"step"} and len(steps_only) == 20
    after = daemon.events(job["id"], after=events[-3]["event_id"])
    assert [e["event_id"] for e in after] == [e["event_id"] for e in events[-2:]]


def test_list_jobs(finished_job, daemon):
    job, _ = finished_job
    r = daemon.http.get("/jobs")
    assert r.status_code == 200
    assert job["id"] in [j["id"] for j in r.json()["jobs"]]
    r = daemon.http.get("/jobs", params={"state": "SUCCEEDED"})
    assert {j["state"] for j in r.json()["jobs"]} == {"SUCCEEDED"}


def _outside_file(daemon) -> Path:
    outside = daemon.data_dir.parent / "outside.jsonl"
    outside.write_text(
        Path(daemon.data_dir / "defaults" / ASSETS_VERSION / "train.jsonl").read_text().splitlines()[0] + "\n"
    )
    return outside


@pytest.mark.parametrize(
    "case, spec, field",
    [
        ("missing dataset", {"datasets": ["no-such-file.jsonl"], "steps": 5}, "datasets[0]"),
        ("path outside root", {"datasets": ["/etc/hostname"], "steps": 5}, "datasets[0]"),
        ("dotdot escape", {"datasets": ["defaults/../../outside.jsonl"], "steps": 5}, "datasets[0]"),
        ("wrong block size", {"datasets": ["builtin://train"], "steps": 5, "block_size": 16}, "block_size"),
        ("wrong seq_len", {"datasets": ["builtin://train"], "steps": 5, "seq_len": 1024}, "seq_len"),
        ("negative lr", {"datasets": ["builtin://train"], "steps": 5, "learning_rate": -0.001}, "learning_rate"),
        ("unknown field", {"datasets": ["builtin://train"], "steps": 5, "learnin_rate": 0.001}, "learnin_rate"),
        ("no steps or epochs", {"datasets": ["builtin://train"]}, "steps"),
        ("no datasets", {"steps": 5}, "datasets"),
        ("unknown builtin", {"datasets": ["builtin://nope"], "steps": 5}, "datasets[0]"),
        (
            "output outside root",
            {"datasets": ["builtin://train"], "steps": 5, "output_dir": "/tmp/dflash-elsewhere"},
            "output_dir",
        ),
        (
            "init_from not a checkpoint",
            {"datasets": ["builtin://train"], "steps": 5, "init_from": "defaults"},
            "init_from",
        ),
    ],
)
def test_invalid_spec_is_422_naming_the_field(daemon, case, spec, field):
    r = daemon.http.post("/jobs", json=spec)
    assert r.status_code == 422, (case, r.text)
    body = r.json()
    assert field in [e["field"] for e in body["errors"]], (case, body)
    assert field in body["detail"]


def test_symlink_escape_is_422(daemon):
    outside = _outside_file(daemon)
    link = daemon.data_dir / "innocent.jsonl"
    if not link.exists():
        os.symlink(outside, link)
    r = daemon.http.post("/jobs", json={"datasets": ["innocent.jsonl"], "steps": 5})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "datasets[0]"
    assert "outside the allowed roots" in r.json()["detail"]
    # the same file inside the root is accepted: the refusal was about the symlink's target
    inside = daemon.data_dir / "inside.jsonl"
    inside.write_text(outside.read_text())
    r = daemon.http.post("/jobs", json={"datasets": ["inside.jsonl"], "steps": 1, "checkpoint_interval": 1})
    assert r.status_code == 202, r.text
    assert daemon.wait_terminal(r.json()["id"])["state"] == "SUCCEEDED"


def test_a_file_of_a_dataset_directory_that_leads_out_is_422_unread(daemon, tmp_path):
    """A dataset directory inside the roots whose file is a symlink out of them: refused before
    that file is opened, whatever it holds (its content would otherwise show in the error)."""
    secret = tmp_path / "secret.jsonl"  # outside the daemon's roots
    secret.write_text("the secret's first line\n")
    folder = daemon.data_dir / "leads-out"
    folder.mkdir()
    (folder / "a.jsonl").symlink_to(secret)
    r = daemon.http.post("/jobs", json={"datasets": ["leads-out"], "steps": 2})
    assert r.status_code == 422, r.text
    message = r.json()["errors"][0]["message"]
    assert "leads-out/a.jsonl" in message and "outside the allowed roots" in message, message
    assert "JSON" not in message and "secret" not in message  # not read
    fifo = daemon.data_dir / "a-fifo.jsonl"
    os.mkfifo(fifo)
    r = daemon.http.post("/jobs", json={"datasets": ["a-fifo.jsonl"], "steps": 2})
    assert r.status_code == 422 and "not a regular file" in r.json()["errors"][0]["message"], r.text


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
def test_malformed_body_is_422(daemon, body):
    r = daemon.http.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body"


def test_unknown_job_is_404(daemon):
    assert daemon.http.get("/jobs/job-doesnotexist").status_code == 404
    assert daemon.http.get("/jobs/job-doesnotexist/events").status_code == 404
    r = daemon.http.post("/jobs/job-doesnotexist/cancel")
    assert r.status_code == 404
    assert "job-doesnotexist" in r.json()["detail"]


def test_cancel_finished_job_is_409(finished_job, daemon):
    job, _ = finished_job
    r = daemon.http.post(f"/jobs/{job['id']}/cancel")
    assert r.status_code == 409
    assert "SUCCEEDED" in r.json()["detail"]


def test_submission_id_is_idempotent(daemon):
    spec = {"datasets": ["builtin://train"], "steps": 3, "checkpoint_interval": 3, "submission_id": "nightly-42"}
    first = daemon.submit(spec, expect=202)
    # same spec, written differently (a default spelled out, other key order): same job
    again = daemon.submit({"seed": 0, **spec}, expect=200)
    assert again["id"] == first["id"]
    r = daemon.http.post("/jobs", json={**spec, "steps": 4})
    assert r.status_code == 409
    assert "nightly-42" in r.json()["detail"] and first["id"] in r.json()["detail"]
    assert daemon.wait_terminal(first["id"])["state"] == "SUCCEEDED"
    assert daemon.submit(spec, expect=200)["id"] == first["id"]  # still the same job once finished
    assert len([j for j in daemon.http.get("/jobs").json()["jobs"] if j["submission_id"] == "nightly-42"]) == 1


def test_cancel_running_job_stops_within_one_step_and_next_job_runs(daemon):
    long = daemon.submit({"datasets": ["builtin://train"], "steps": 5000, "checkpoint_interval": 1000, "name": "long"})
    queued = daemon.submit({"datasets": ["builtin://train"], "steps": 4, "checkpoint_interval": 2, "name": "next"})
    assert queued["state"] == "PENDING"
    daemon.wait_job(long["id"], lambda j: j["state"] == "RUNNING" and j["progress"]["step"] >= 3)
    assert daemon.job(queued["id"])["queue_position"] == 0

    r = daemon.http.post(f"/jobs/{long['id']}/cancel")
    assert r.status_code == 202, r.text
    step_at_cancel = r.json()["progress"]["step"]
    assert r.json()["cancel_requested"] is True

    stopped = daemon.wait_terminal(long["id"], timeout=30)
    assert stopped["state"] == "STOPPED"
    final = stopped["progress"]["step"]
    assert step_at_cancel <= final <= step_at_cancel + 1
    assert stopped["progress"]["last_checkpoint"].endswith(f"step-{final:08d}")  # resumable state kept
    assert daemon.http.post(f"/jobs/{long['id']}/cancel").status_code == 409

    nxt = daemon.wait_terminal(queued["id"], timeout=60)
    assert nxt["state"] == "SUCCEEDED"
    assert nxt["started_at"] >= stopped["finished_at"]


def test_cancel_pending_job_stops_it_without_running(daemon):
    blocker = daemon.submit({"datasets": ["builtin://train"], "steps": 5000, "checkpoint_interval": 1000})
    pending = daemon.submit({"datasets": ["builtin://train"], "steps": 5})
    r = daemon.http.post(f"/jobs/{pending['id']}/cancel")
    assert r.status_code == 200
    assert r.json()["state"] == "STOPPED" and r.json()["started_at"] is None
    assert daemon.http.post(f"/jobs/{blocker['id']}/cancel").status_code in (200, 202)
    assert daemon.wait_terminal(blocker["id"], timeout=30)["state"] == "STOPPED"
    assert step_numbers(daemon.events(pending["id"])) == []


def _metrics(daemon) -> tuple[dict, str]:
    r = daemon.http.get("/metrics", follow_redirects=False)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}, r.text


def _value(families, name, **labels) -> float:
    """The value of sample `name` (e.g. dflash_compiles_total, a histogram's _count) with these labels."""
    matches = [
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert matches, (name, labels)
    return matches[0]


def test_metrics_after_a_job(finished_job, daemon):
    families, text = _metrics(daemon)
    # every contract name (docs/design.md) is exported; the parser strips _total from counter names
    for name in CONTRACT_METRICS:
        assert name.removesuffix("_total") in families, name
    for counter in (
        "dflash_compiles_total",
        "dflash_train_tokens_total",
        "dflash_cuda_alloc_retries_total",
        "dflash_cuda_ooms_total",
    ):
        assert f"# TYPE {counter.removesuffix('_total')} counter" in text or f"# TYPE {counter} counter" in text

    assert _value(families, "dflash_ready") == 1
    assert _value(families, "dflash_drafters_ready") == _value(families, "dflash_drafters_expected") == 1
    assert _value(families, "dflash_compiles_total", phase="runtime") == 0
    assert _value(families, "dflash_compiles_total", phase="warmup") >= 0
    assert _value(families, "dflash_train_tokens_total", device="cpu") > 0
    assert _value(families, "dflash_train_tokens_per_second") >= 0
    # the series added with the checkpoint pause: versions and the standard process collector
    assert _value(families, "dflash_build_info") == 1
    assert _value(families, "process_resident_memory_bytes") > 0
    # every checkpoint's pause is observed, and reported with its event
    assert _value(families, "dflash_checkpoint_pause_seconds_count") >= 1
    checkpoints = [e for e in daemon.events(finished_job[0]["id"]) if e["kind"] == "checkpoint"]
    assert checkpoints and all(e["pause_seconds"] >= 0 for e in checkpoints)
    assert _value(families, "dflash_train_step_seconds_count", device="cpu") >= 20
    assert _value(families, "dflash_train_step_seconds_sum", device="cpu") > 0
    # the per-job gauges hold the series of the job that ran last (other tests of this module run jobs
    # after finished_job; test_per_job_gauges_follow_the_job checks their values)
    for name in PER_JOB_GAUGES:
        jobs = {s.labels.get("job_id") for s in families[name].samples}
        assert len(jobs) == 1 and next(iter(jobs)).startswith("job-"), (name, jobs)
    assert _value(families, "dflash_warmup_seconds", component="drafter", device="cpu") > 0
    assert _value(families, "dflash_queue_depth", queue="jobs") >= 0
    assert _value(families, "dflash_jobs", state="SUCCEEDED") >= 1
    for state in ("PENDING", "RUNNING", "FAILED", "STOPPED"):
        assert _value(families, "dflash_jobs", state=state) >= 0
    assert families["dflash_cuda_allocated_bytes"].samples == []  # no CUDA device here: no samples, no fake zeros


def _job_samples(families, name: str) -> dict[tuple[str, ...], float]:
    """A per-job gauge's samples: (job,) or (job, position) -> value."""
    return {
        tuple(s.labels[k] for k in ("job_id", "position") if k in s.labels): s.value for s in families[name].samples
    }


def test_per_job_gauges_follow_the_job(daemon):
    """Loss, accuracy, learning rate, gradient norm, acceptance lengths and data preparation carry the
    job's id as `job_id`; a finished job's values stay until the next job starts, which removes them."""
    first = daemon.submit(
        {
            "datasets": ["builtin://train"],
            "steps": 2,
            "checkpoint_interval": 2,
            "eval_prompts": "builtin://heldout",
            "eval_interval": 2,
            "eval_max_prompts": 1,
            "eval_max_new_tokens": 8,
        }
    )
    assert daemon.wait_terminal(first["id"])["state"] == "SUCCEEDED"
    families, _ = _metrics(daemon)
    for name in PER_JOB_GAUGES:
        assert {key[0] for key in _job_samples(families, name)} == {first["id"]}, name
    one = {
        name: _job_samples(families, name)[(first["id"],)] for name in PER_JOB_GAUGES if name != "dflash_train_accuracy"
    }
    assert 0 < one["dflash_train_loss"] < 20
    assert one["dflash_train_learning_rate"] > 0 and one["dflash_train_grad_norm"] >= 0
    assert one["dflash_train_expected_acceptance_length"] >= 1 and one["dflash_eval_acceptance_length"] >= 1
    assert one["dflash_data_prepare_progress_ratio"] == 1.0 and one["dflash_data_prepare_tokens"] > 0
    accuracy = _job_samples(families, "dflash_train_accuracy")
    assert sorted(accuracy) == [(first["id"], str(p)) for p in range(1, 8)]  # block size 8: positions 1..7
    assert all(0 <= v <= 1 for v in accuracy.values())

    second = daemon.submit({"datasets": ["builtin://train"], "steps": 1})
    assert daemon.wait_terminal(second["id"])["state"] == "SUCCEEDED"
    families, text = _metrics(daemon)
    assert first["id"] not in text
    for name in PER_JOB_GAUGES:
        assert {key[0] for key in _job_samples(families, name)} == {second["id"]}, name
    # the second job evaluates nothing: its held-out acceptance length is not measured (NaN), not the first's
    assert math.isnan(_job_samples(families, "dflash_eval_acceptance_length")[(second["id"],)])
    assert 0 < _job_samples(families, "dflash_train_loss")[(second["id"],)] < 20


def test_metrics_path_has_no_redirect(daemon):
    r = daemon.http.get("/metrics", follow_redirects=False)
    assert r.status_code == 200 and not r.history


def test_livez_and_no_files_in_cwd(daemon):
    r = daemon.http.get("/livez")
    assert r.status_code == 200 and r.json()["status"] == "alive"
    assert list(daemon.workdir.iterdir()) == []


def test_job_with_a_bad_dataset_line_fails_with_a_readable_error(daemon):
    good_line = (daemon.data_dir / "defaults" / ASSETS_VERSION / "train.jsonl").read_text().splitlines()[0]
    # among the first records: refused at submission, naming the file and the line
    early = daemon.data_dir / "broken-early.jsonl"
    early.write_text(good_line + "\n{this is not json\n")
    r = daemon.http.post("/jobs", json={"datasets": ["broken-early.jsonl"], "steps": 2})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "datasets[0]", r.text
    assert "broken-early.jsonl:2" in r.text and "JSON" in r.text
    # deeper in the file: the job fails when it prepares its data, naming the file and the line
    bad = daemon.data_dir / "broken.jsonl"
    bad.write_text((good_line + "\n") * 40 + "{this is not json\n")
    job = daemon.submit({"datasets": ["broken.jsonl"], "steps": 2})
    failed = daemon.wait_terminal(job["id"])
    assert failed["state"] == "FAILED"
    assert "broken.jsonl:41" in failed["error"] and "JSON" in failed["error"]
    # as the client named it: a relative path, not the data directory it resolves under
    assert " broken.jsonl:41" in failed["error"] and str(daemon.data_dir) not in failed["error"], failed["error"]
    assert daemon.events(job["id"])[-1]["error"] == failed["error"]
    # skip_bad_lines trains on what is readable and says how much it skipped, and where
    job = daemon.submit({"datasets": ["broken.jsonl"], "steps": 2, "skip_bad_lines": True})
    assert daemon.wait_terminal(job["id"])["state"] == "SUCCEEDED"
    skipped = [e for e in daemon.events(job["id"]) if e["kind"] == "skipped_lines"]
    assert skipped and skipped[0]["count"] == 1
    assert [m.split(": ")[0] for m in skipped[0]["first"]] == ["broken.jsonl:41"], skipped
    # the data preparation was a phase of its own, with progress in the events
    prepared = [e for e in daemon.events(job["id"]) if e["kind"] == "preparing_data"]
    assert prepared and prepared[-1]["done"] and prepared[-1]["fraction"] == 1.0 and prepared[-1]["documents"] == 40


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"steps": "7"}, "steps"),
        ({"steps": True}, "steps"),
        ({"steps": 10**23}, "steps"),
        ({"seed": 10**23}, "seed"),
        ({"grad_accum": 10**6}, "grad_accum"),
        ({"skip_bad_lines": "yes"}, "skip_bad_lines"),
        ({"datasets": ["~nosuchuserxyz/a.jsonl"]}, "datasets[0]"),
        ({"datasets": ["x" * 5000]}, "datasets[0]"),
        ({"output_dir": "y" * 300}, "output_dir"),
        ({"output_dir": "jobs/ok\nnewline"}, "output_dir"),  # `status` prints it
        ({"output_dir": "jobs/real\u202edir"}, "output_dir"),  # reads reversed in a terminal
        ({"output_dir": "dflash.sqlite3/x"}, "output_dir"),  # a file on its path: FAILED at start otherwise
    ],
)
def test_hostile_values_are_422_naming_the_field(daemon, patch, field):
    r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 2, **patch})
    assert r.status_code == 422, r.text
    assert field in {e["field"] for e in r.json()["errors"]}, r.json()


def test_hostile_bodies_and_queries(daemon, finished_job):
    nested = b"[" * 100_000 + b"]" * 100_000
    r = daemon.http.post("/jobs", content=nested, headers={"content-type": "application/json"})
    assert r.status_code in (413, 422), r.text
    r = daemon.http.post(
        "/jobs", content=b'{"datasets": ["' + b"a" * (2 << 20) + b'"]}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    job, _ = finished_job
    r = daemon.http.get(f"/jobs/{job['id']}/events", params={"after": 10**23})
    assert r.status_code == 422


def test_output_dir_of_another_job_is_refused(daemon, finished_job):
    first = daemon.submit({"datasets": ["builtin://train"], "steps": 1, "output_dir": "jobs/shared-out"})
    assert daemon.wait_terminal(first["id"])["state"] == "SUCCEEDED"
    r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, "output_dir": "jobs/shared-out"})
    assert r.status_code == 409 and "shared-out" in r.json()["detail"]
    # named as the client gave it, not where it resolves (a 409 is readable by any client)
    assert "output_dir 'jobs/shared-out'" in r.json()["detail"] and str(daemon.data_dir) not in r.text, r.text
    # a directory no job owns that holds checkpoints is refused the same way
    (daemon.data_dir / "jobs" / "stale-out" / "checkpoints" / "step-00000001").mkdir(parents=True)
    r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, "output_dir": "jobs/stale-out"})
    assert r.status_code == 409 and "output_dir 'jobs/stale-out' already holds checkpoints" in r.json()["detail"]
    assert str(daemon.data_dir) not in r.text, r.text


def test_promtool_accepts_the_metrics_page(finished_job, daemon, tmp_path):
    """`promtool check metrics` (Debian's prometheus package brings it; .ci/run installs it) finds
    nothing to complain about: no gauge named like a counter, units and help texts in place."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool: install the Debian package `prometheus` (.ci/run does)")
    page = daemon.http.get("/metrics").text
    done = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
