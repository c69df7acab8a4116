"""Persistence across process deaths: SIGTERM checkpoints the running job and leaves it
resumable; SIGKILL loses at most the steps since the last checkpoint. Either way the job resumes
at the next start, its step count continues and no step event is duplicated or lost."""

from __future__ import annotations

import sqlite3

import pytest

from tests.service.harness import step_numbers

# the kill lands between two checkpoints: a window of steps 3 to 9 past a checkpoint after the
# first resume's, three such windows before the job ends
STEPS = 50
INTERVAL = 10


def _db_state(daemon, job_id: str) -> tuple[str, int, int | None]:
    db = sqlite3.connect(str(daemon.data_dir / "dflash.sqlite3"))
    try:
        return db.execute("SELECT state, step, last_checkpoint_step FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        db.close()


@pytest.mark.slow  # restarts a real daemon (an engine warm-up each start)
def test_job_survives_sigterm_and_sigkill(daemon):
    d = daemon
    job = d.submit(
        {"datasets": ["builtin://train"], "steps": STEPS, "checkpoint_interval": INTERVAL, "name": "survivor"}
    )
    queued_behind = d.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2, "name": "behind"})

    # 1. graceful stop: the job checkpoints at its current step and stays RUNNING (resumable)
    d.wait_job(job["id"], lambda j: j["progress"]["step"] >= 12)
    assert d.stop() in (0, -15)
    state, step, ckpt_step = _db_state(d, job["id"])
    assert state == "RUNNING"
    assert ckpt_step == step >= 12  # a checkpoint at exactly the step it stopped at: nothing to redo

    d.start()
    d.wait_ready()
    resumed = d.wait_job(job["id"], lambda j: j["progress"]["step"] > step)
    assert resumed["resumes"] == 1
    events = d.events(job["id"])
    first_resume = [e for e in events if e["kind"] == "resumed"]
    assert len(first_resume) == 1 and first_resume[0]["step"] == step
    assert first_resume[0]["reason"] == "the daemon was shut down" and first_resume[0]["steps_lost"] == 0

    # 2. SIGKILL between checkpoints: the steps after the last checkpoint are redone, once
    killed_job = d.wait_job(
        job["id"],
        lambda j: (
            (j["progress"]["last_checkpoint_step"] or 0) >= step + INTERVAL - step % INTERVAL
            and j["progress"]["step"] % INTERVAL >= 3
        ),
    )
    d.kill()
    state, step_at_kill, ckpt_at_kill = _db_state(d, job["id"])
    assert state == "RUNNING" and step_at_kill > ckpt_at_kill >= killed_job["progress"]["last_checkpoint_step"]

    d.start()
    d.wait_ready()
    final = d.wait_terminal(job["id"], timeout=120)
    assert final["state"] == "SUCCEEDED", final
    assert final["progress"]["step"] == final["progress"]["total_steps"] == STEPS
    assert final["resumes"] == 2
    assert final["progress"]["last_checkpoint"].endswith(f"step-{STEPS:08d}")

    events = d.events(job["id"])
    resumes = [e for e in events if e["kind"] == "resumed"]
    assert [r["step"] for r in resumes] == [step, ckpt_at_kill]
    assert resumes[1]["reason"] == "the daemon was killed or crashed"
    assert resumes[1]["steps_lost"] == step_at_kill - ckpt_at_kill
    # the step count continues after each resume, and every step is recorded exactly once
    steps = step_numbers(events)
    assert steps == list(range(1, STEPS + 1))
    after_kill = events.index(resumes[1])
    assert step_numbers(events[after_kill:])[0] == ckpt_at_kill + 1
    checkpoint_steps = [e["step"] for e in events if e["kind"] == "checkpoint"]
    assert len(checkpoint_steps) == len(set(checkpoint_steps))
    states = [e["state"] for e in events if e["kind"] == "state"]
    assert states == ["PENDING", "RUNNING", "SUCCEEDED"]

    # the job queued behind it kept its place and ran afterwards
    assert d.wait_terminal(queued_behind["id"])["state"] == "SUCCEEDED"
    assert d.job(queued_behind["id"])["started_at"] >= final["finished_at"]


@pytest.mark.slow  # starts a second daemon
def test_second_daemon_on_same_data_dir_refuses_to_start(daemon):
    from tests.service.harness import Daemon

    first = daemon  # the module's, running
    second = Daemon(first.config_path, first.data_dir, first.workdir)
    try:
        second.start()
    except RuntimeError as e:
        assert "another dflash-trainer daemon" in str(e)
    else:
        raise AssertionError("a second daemon started on the same data dir")
    finally:
        second.close()
    assert first.http.get("/livez").status_code == 200
