"""The CLI's job commands against a real daemon: `status --state --limit`, `resume JOB`, a "did
you mean" for an unknown job field (HTTP 422 and the CLI's message), and an ETA that comes from
the step rate on the daemon's clock, right after re-attaching."""

from __future__ import annotations

import json

import pytest

from service.progress import WINDOW, StepRate, progress_line
from tests.service.test_cli import cli


@pytest.fixture(scope="module")
def daemon(make_daemon):
    """A daemon of the module's own: its status listings are compared whole, with no job of
    another module among them."""
    d = make_daemon()
    d.wait_ready()
    return d


def test_an_unknown_field_gets_a_did_you_mean(daemon, tmp_path):
    r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 3, "lr": 0.1, "max_step": 4})
    assert r.status_code == 422
    messages = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert messages["lr"].endswith("did you mean 'learning_rate'?")
    assert messages["max_step"].endswith("did you mean 'steps'?")
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"datasets": ["builtin://train"], "steps": 3, "learnig_rate": 1e-3}))
    done = cli("submit", str(spec), url=daemon.url)
    assert done.returncode == 2 and "learnig_rate: unknown field" in done.stderr
    assert "did you mean 'learning_rate'?" in done.stderr


@pytest.mark.slow
def test_status_filters_and_resume_continues_a_stopped_job(daemon):
    done = daemon.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2, "name": "short"})
    daemon.wait_terminal(done["id"])
    job = daemon.submit({"datasets": ["builtin://train"], "steps": 400, "checkpoint_interval": 2, "name": "long"})
    daemon.wait_job(job["id"], lambda j: bool(j["checkpoints"]))
    daemon.http.post(f"/jobs/{job['id']}/cancel")
    assert daemon.wait_terminal(job["id"])["state"] == "STOPPED"

    listed = cli("status", "--state", "stopped", "--json", url=daemon.url)
    assert listed.returncode == 0, listed.stderr
    assert [j["id"] for j in json.loads(listed.stdout)] == [job["id"]]
    newest = cli("status", "--limit", "1", url=daemon.url)
    assert newest.returncode == 0 and job["id"] in newest.stdout and done["id"] not in newest.stdout
    assert "no FAILED jobs" in cli("status", "--state", "FAILED", url=daemon.url).stdout
    bad = cli("status", "--state", "DONE", url=daemon.url)
    assert bad.returncode == 2 and "is not one of" in bad.stderr
    assert cli("status", "--limit", "0", url=daemon.url).returncode == 2

    resumed = cli("resume", job["id"], url=daemon.url)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{job['id']} PENDING" in resumed.stdout
    after = daemon.wait_job(job["id"], lambda j: j["state"] == "RUNNING" or j["state"] in ("SUCCEEDED", "FAILED"))
    assert after["state"] != "FAILED"
    daemon.http.post(f"/jobs/{job['id']}/cancel")
    daemon.wait_terminal(job["id"])
    again = cli("resume", done["id"], url=daemon.url)  # a SUCCEEDED job has nothing to resume
    assert again.returncode == 2 and "409" in again.stderr


def test_eta_comes_from_the_step_rate_not_the_arrival_of_events():
    """Re-attaching replays the past at once; the rate is read from the events' times."""
    rate = StepRate()
    rate.observe({"kind": "state", "state": "RUNNING", "time": 1000.0})
    for step in range(1, 110):  # 0.42 s per step on the daemon's clock, received in one burst
        rate.observe({"kind": "step", "step": step, "time": 1000.0 + 0.42 * step, "total_steps": 200})
    elapsed, eta = rate.times(200)
    assert elapsed == pytest.approx(0.42 * 109)
    assert eta == pytest.approx(0.42 * 91)
    line = progress_line({"step": 109, "total_steps": 200, "loss": 1.5, "tokens_per_second": 1e4}, elapsed, eta)
    assert line.startswith("step 109/200 [") and "54.5%" in line and "loss 1.5000" in line
    assert line.endswith("00:45 elapsed, ETA 00:38")
    # a resume recomputes steps from its checkpoint: the rate starts over
    rate.observe({"kind": "resumed", "time": 5000.0, "step": 100})
    rate.observe({"kind": "step", "step": 101, "time": 5001.0})
    assert rate.times(200) == (1.0, None)
    rate.observe({"kind": "step", "step": 102, "time": 5003.0})
    assert rate.times(200) == (3.0, pytest.approx(98 * 2.0))


@pytest.mark.slow
def test_the_eta_of_a_real_job_is_its_recent_step_rate_over_the_steps_left(daemon):
    """Fed a real job's event stream up to step 20 of 40, the ETA is the 20 steps left at the
    rate of the last WINDOW step events, and the elapsed time runs from the RUNNING state (both on
    the daemon's clock; no wall-clock race with the machine's load)."""
    job = daemon.submit({"datasets": ["builtin://train"], "steps": 40, "checkpoint_interval": 40})
    daemon.wait_terminal(job["id"])
    events = daemon.events(job["id"])
    rate = StepRate()
    for e in events:
        rate.observe(e)
        if e["kind"] == "step" and e["step"] == 20:
            break
    elapsed, eta = rate.times(40)
    window = [(e["step"], e["time"]) for e in events if e["kind"] == "step" and e["step"] <= 20][-WINDOW:]
    (s0, t0), (s1, t1) = window[0], window[-1]
    expected = (40 - 20) * (t1 - t0) / (s1 - s0)
    running = next(e["time"] for e in events if e["kind"] == "state" and e.get("state") == "RUNNING")
    assert eta == pytest.approx(expected) and eta > 0
    assert elapsed == pytest.approx(t1 - running)


def test_a_decoder_line_says_its_riding_rows_and_widths():
    from service.cli_jobs import _event_message

    base = {"kind": "decoder", "slots": 256, "length": 1024, "kv_cache_bytes": 2**30, "cuda_graph": True}
    wide = _event_message({**base, "ride_rows": 512, "ride_widths": [512, 128, 32, 8]})
    assert wide is not None and wide.endswith("prompt tokens riding per step up to 512 (steps of 512/128/32/8 rows)")
    one = _event_message({**base, "ride_rows": 6, "ride_widths": [6]})
    assert one is not None and one.endswith("prompt tokens riding per step up to 6")
    none = _event_message({**base, "ride_rows": 0, "ride_widths": []})
    assert none is not None and none.endswith("prompt tokens riding per step 0")


def test_a_regeneration_shard_is_told_as_a_shard_not_a_step():
    from service.cli_jobs import _event_message

    shard = {"kind": "checkpoint", "step": 128, "path": "/data/out/shard-00003.parquet"}
    assert _event_message(shard) == "shard shard-00003.parquet written: 128 rows so far"
    step = {"kind": "checkpoint", "step": 40, "path": "/data/out/checkpoints/step-00000040"}
    assert _event_message(step) == "checkpoint step 40: /data/out/checkpoints/step-00000040"
