"""The CLI against a real daemon, as a user runs it: --version, distinct exit codes, `logs`
re-attaching to a job, and `submit --follow` that rides out a daemon restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO_ROOT, run_cli

pytestmark = pytest.mark.slow


def cli(*args: str, url: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli(*args, *(["--url", url] if url else []), timeout=timeout)


def test_version_and_exit_codes(daemon, tmp_path):
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("dflash-trainer ")
    bad = tmp_path / "bad.json"
    bad.write_text('{"datasets": ["builtin://train"], "steps": 0}')
    assert cli("submit", str(bad), url=daemon.url).returncode == 2  # the daemon refused it (422)
    assert cli("status", url="http://127.0.0.1:9").returncode == 4  # nothing answers there
    assert cli("status", "job-doesnotexist", url=daemon.url).returncode == 2  # 404


def test_logs_reattach_and_report_the_jobs_outcome(daemon):
    job = daemon.submit({"datasets": ["builtin://train"], "steps": 6, "checkpoint_interval": 3})
    followed = cli("logs", job["id"], "--follow", url=daemon.url)
    assert followed.returncode == 0, followed.stderr
    assert "SUCCEEDED" in followed.stdout and "checkpoint step 3" in followed.stdout
    assert "elapsed" in followed.stdout and "ETA" in followed.stdout
    plain = cli("logs", job["id"], url=daemon.url)
    assert plain.returncode == 0 and "state SUCCEEDED" in plain.stdout
    assert "first step after" in plain.stdout and "data_open" in plain.stdout  # where the start went


def test_submit_follow_survives_a_daemon_restart(daemon, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text('{"datasets": ["builtin://train"], "steps": 60, "checkpoint_interval": 10}')
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    follower = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "submit", str(spec), "--follow", "--url", daemon.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # until the job is a few steps in
            jobs = daemon.http.get("/jobs").json()["jobs"]
            running = [j for j in jobs if j["state"] == "RUNNING" and j["progress"]["total_steps"] == 60]
            if running and running[0]["progress"]["step"] >= 12:
                break
            assert time.monotonic() < deadline, jobs
            time.sleep(0.2)
        daemon.stop()  # SIGTERM: the job checkpoints and resumes at the next start
        daemon.start()
        out, err = follower.communicate(timeout=240)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, err + out
    assert "reconnecting" in out and "SUCCEEDED at step 60/60" in out


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """The CLI with its stdout a pipe whose reader is gone before it writes, as `| head` leaves it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "service.cli", *args], stdout=write, stderr=subprocess.PIPE, env=env, timeout=120
        )
    finally:
        os.close(write)


def test_output_closed_early_ends_quietly(daemon):
    daemon.submit({"datasets": ["builtin://train"], "steps": 1})
    for args in (("completion", "bash"), ("status", "--json", "--url", daemon.url), ("status", "--url", daemon.url)):
        done = _into_closed_pipe(*args)
        assert done.returncode == 141, (args, done.returncode, done.stderr)
        assert done.stderr == b"", (args, done.stderr.decode(errors="replace"))
