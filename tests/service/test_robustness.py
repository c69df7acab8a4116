"""The daemon under failures of its surroundings, each against real daemons: a data directory
whose disk fills up for a while, concurrent submissions for one output_dir, crash loops, jobs put
back in the queue through POST /jobs/{id}/resume, and partial checkpoint writes left by a crash."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.jobs.manager import MAX_CRASH_RESUMES
from tests.helpers import mount_tmpfs, unmount
from tests.service.harness import Daemon, step_numbers, write_config
from tests.service.test_store import fill

PARTIAL = ".tmp-step-00000010-abcd1234"  # what a crash in the middle of a checkpoint write leaves


def _plant_partial_write(checkpoints: Path) -> Path:
    partial = checkpoints / PARTIAL
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 4096)
    return partial


def _states(daemon: Daemon, job_id: str) -> list[str]:
    return [e["state"] for e in daemon.events(job_id, kind="state")]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return result


# --------------------------------------------------------------------------- a full data directory
@pytest.fixture
def daemon_on_small_disk(tmp_path):
    """A daemon whose data directory is a 64 MiB tmpfs (job store, assets, checkpoints)."""
    data_dir, workdir = tmp_path / "data", tmp_path / "cwd"
    workdir.mkdir()
    mount_tmpfs(data_dir, "size=64m")
    daemon = Daemon(write_config(tmp_path / "dflash.toml", data_dir), data_dir, workdir)
    try:
        yield daemon
    finally:
        daemon.close()
        unmount(data_dir)


@pytest.mark.slow  # fills a tmpfs during a job, then restarts the daemon
def test_a_full_data_dir_is_survived(daemon_on_small_disk):
    """While the data directory's disk is full the job store cannot write: the worker lives
    (/livez 200), submissions are 503 with the reason, the running job waits; once space is
    back the running job resumes from its checkpoint and the queued jobs run."""
    d = daemon_on_small_disk.start()
    d.wait_ready()
    job = d.submit({"datasets": ["builtin://train"], "steps": 60, "checkpoint_interval": 10, "name": "through"})
    # between two checkpoints: the next step's record is the first write to fail
    d.wait_job(
        job["id"], lambda j: (j["progress"]["last_checkpoint_step"] or 0) >= 10 and 2 <= j["progress"]["step"] % 10 <= 5
    )
    filler = d.data_dir / "filler"
    fill(filler)

    small = {"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2}
    accepted = []  # submissions the store could still take into space it already held

    def refused():
        r = d.http.post("/jobs", json=small)
        assert r.status_code in (202, 503), r.text
        if r.status_code == 202:
            accepted.append(r.json()["id"])
        return r if r.status_code == 503 else None

    r = _wait(refused, 30, "submissions never answered 503 on a full disk")
    assert "the job store cannot write: database or disk is full" in r.json()["detail"], r.text
    for _ in range(15):  # the worker outlives the failed writes, and the job waits as RUNNING
        live = d.http.get("/livez")
        assert live.status_code == 200 and live.json()["job_worker_alive"], live.text
        assert d.job(job["id"])["state"] == "RUNNING"
        time.sleep(0.2)
    assert d.http.post("/jobs", json=small).status_code == 503

    filler.unlink()
    after = d.submit(small)  # the store writes again at once
    final = d.wait_terminal(job["id"])
    assert final["state"] == "SUCCEEDED", final
    events = d.events(job["id"])
    assert step_numbers(events) == list(range(1, 61))  # every step recorded once, none lost
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert len(resumed) == 1 and "the job store cannot write: database or disk is full" in resumed[0]["reason"]
    assert resumed[0]["step"] >= 10 and resumed[0]["checkpoint"].endswith(f"step-{resumed[0]['step']:08d}")
    assert final["resumes"] == 1 and _states(d, job["id"]) == ["PENDING", "RUNNING", "SUCCEEDED"]
    for queued in [*accepted, after["id"]]:
        assert d.wait_terminal(queued)["state"] == "SUCCEEDED"
    assert d.http.get("/livez").status_code == 200


# --------------------------------------------------------------------------- shared daemon
# the shared daemon's max_crash_resumes, below the default (MAX_CRASH_RESUMES): the crash-loop
# test shows the rule with fewer daemon starts (one crash resumed, the second in a row failing the
# job); no other test here crashes a daemon
CRASH_RESUMES = 1
CRASHER_STEPS = 40  # the crash-loop test's job


@pytest.fixture(scope="module")
def daemon(make_daemon):
    """The module's daemon, for the tests below in this order: the last restarts it."""
    d = make_daemon(settings={"max_crash_resumes": CRASH_RESUMES})
    d.wait_ready()
    return d


@pytest.mark.slow  # many concurrent submissions, each job runs
def test_concurrent_submissions_for_one_output_dir_accept_exactly_one(daemon):
    """Eight submissions for the same output_dir at the same moment: the store accepts one (202)
    and refuses the others (409, naming the owner), round after round."""
    accepted = []
    for round_ in range(5):
        spec = {"datasets": ["builtin://train"], "steps": 1, "output_dir": f"jobs/race-{round_}"}
        start = threading.Barrier(8)

        def submit(spec=spec, start=start) -> httpx.Response:
            with httpx.Client(base_url=daemon.url, timeout=60) as client:
                start.wait()
                return client.post("/jobs", json=spec)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: submit(), range(8)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [202] + [409] * 7, [(r.status_code, r.text) for r in answers]
        winner = next(r.json()["id"] for r in answers if r.status_code == 202)
        assert all(winner in r.json()["detail"] for r in answers if r.status_code == 409)
        accepted.append(winner)
    for job_id in accepted:
        assert daemon.wait_terminal(job_id)["state"] == "SUCCEEDED"


@pytest.mark.slow  # a job stopped and run to its end
def test_a_stopped_job_resumes_through_the_api(daemon):
    """POST /jobs/{id}/resume puts a cancelled job back in the queue under its id; it resumes from
    its checkpoint (a partial write left beside it is removed first) and its steps continue from
    there to the end, each recorded once."""
    job = daemon.submit({"datasets": ["builtin://train"], "steps": 30, "checkpoint_interval": 5, "name": "again"})
    daemon.wait_job(job["id"], lambda j: j["progress"]["step"] >= 7)
    assert daemon.http.post(f"/jobs/{job['id']}/resume").status_code == 409  # RUNNING: nothing to resume
    assert daemon.http.post(f"/jobs/{job['id']}/cancel").status_code == 202
    stopped = daemon.wait_terminal(job["id"])
    assert stopped["state"] == "STOPPED"
    at = stopped["progress"]["step"]
    assert stopped["progress"]["last_checkpoint_step"] == at < 30
    partial = _plant_partial_write(Path(stopped["output_dir"]) / "checkpoints")

    r = daemon.http.post(f"/jobs/{job['id']}/resume")
    assert r.status_code == 202, r.text
    assert r.json()["id"] == job["id"] and r.json()["state"] in ("PENDING", "RUNNING")
    assert r.json()["finished_at"] is None and r.json()["cancel_requested"] is False
    final = daemon.wait_terminal(job["id"])
    assert final["state"] == "SUCCEEDED", final
    assert final["progress"]["step"] == 30 and final["progress"]["last_checkpoint"].endswith("step-00000030")
    assert not partial.exists()

    events = daemon.events(job["id"])
    assert step_numbers(events) == list(range(1, 31))
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == at and resumed[0]["reason"] == "resume requested"
    assert step_numbers(events[events.index(resumed[0]) :])[0] == at + 1  # continues from the checkpoint
    requeued = [e for e in events if e["kind"] == "state" and e.get("reason") == "resume requested"]
    assert len(requeued) == 1 and requeued[0]["previous_state"] == "STOPPED" and requeued[0]["checkpoint_step"] == at
    assert _states(daemon, job["id"]) == ["PENDING", "RUNNING", "STOPPED", "PENDING", "RUNNING", "SUCCEEDED"]
    assert daemon.http.post(f"/jobs/{job['id']}/resume").status_code == 409  # SUCCEEDED


def test_resume_is_refused_without_a_checkpoint(daemon):
    assert daemon.http.post("/jobs/job-doesnotexist/resume").status_code == 404
    blocker = daemon.submit({"datasets": ["builtin://train"], "steps": 5000, "checkpoint_interval": 1000})
    never_ran = daemon.submit({"datasets": ["builtin://train"], "steps": 5})
    assert daemon.http.post(f"/jobs/{never_ran['id']}/resume").status_code == 409  # PENDING
    assert daemon.http.post(f"/jobs/{never_ran['id']}/cancel").status_code == 200
    r = daemon.http.post(f"/jobs/{never_ran['id']}/resume")
    assert r.status_code == 409 and "no checkpoint" in r.json()["detail"], r.text
    assert daemon.http.post(f"/jobs/{blocker['id']}/cancel").status_code in (200, 202)
    assert daemon.wait_terminal(blocker["id"])["state"] == "STOPPED"


# --------------------------------------------------------------------------- restarts
@pytest.mark.slow  # restarts a real daemon (an engine warm-up each start)
def test_crash_loop_fails_the_job_and_the_api_resumes_it(daemon):
    """Crashes count toward the guard only in a row without a new checkpoint: killed each time
    soon after it resumed (its only checkpoint by cadence is its last step), the job fails when
    the daemon starts for the (max_crash_resumes + 1)th time after such a crash, with the reason.
    POST /jobs/{id}/resume continues it from its checkpoint to the end. With max_crash_resumes
    CRASH_RESUMES (the module daemon's; the default is MAX_CRASH_RESUMES): the rule is the same,
    with fewer daemon starts.

    The first of these starts also shows the sweep of interrupted checkpoint writes: at start the
    daemon removes the temporary directories of such writes from the output directory of every
    job it knows (a finished job's here), and nothing else."""
    limit = CRASH_RESUMES
    assert limit < MAX_CRASH_RESUMES
    d = daemon
    d.wait_ready()
    finished = d.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 1})
    assert d.wait_terminal(finished["id"])["state"] == "SUCCEEDED"
    finished_checkpoints = Path(finished["output_dir"]) / "checkpoints"
    # its only checkpoint by cadence is its last step; each kill lands right after a resume, dozens
    # of steps before that
    job = d.submit(
        {
            "datasets": ["builtin://train"],
            "steps": CRASHER_STEPS,
            "checkpoint_interval": CRASHER_STEPS,
            "name": "crasher",
        }
    )
    d.wait_job(job["id"], lambda j: j["progress"]["step"] >= 3)
    assert d.stop() in (0, -15)  # checkpoints the current step: the resume point; no crash
    partial = _plant_partial_write(finished_checkpoints)
    not_ours = _plant_partial_write(d.data_dir / "jobs" / "not-a-job" / "checkpoints")
    for crashes_in_a_row in range(limit + 2):  # as counted when the daemon starts again
        d.start()
        if crashes_in_a_row == 0:  # the sweep at start
            _wait(lambda: not partial.exists(), 30, f"{partial} was not removed at start")
            assert sorted(p.name for p in finished_checkpoints.iterdir()) == ["step-00000001", "step-00000002"]
            assert not_ours.exists()
        d.wait_ready()
        if crashes_in_a_row > limit:
            break
        # killed as soon as the job resumed, long before its next checkpoint
        _wait(lambda n=crashes_in_a_row: len(d.events(job["id"], kind="resumed")) == n + 1, 60, "no resume")
        d.kill()
    failed = d.wait_terminal(job["id"])
    assert failed["state"] == "FAILED", failed
    resumed = [e for e in d.events(job["id"]) if e["kind"] == "resumed"]
    at = resumed[0]["step"]
    assert at >= 3 and [e["step"] for e in resumed] == [at] * (limit + 1)
    assert resumed[0]["reason"] == "the daemon was shut down"
    assert {e["reason"] for e in resumed[1:]} == {"the daemon was killed or crashed"}
    assert f"died {limit + 1} times in a row" in failed["error"]
    assert f"POST /jobs/{job['id']}/resume continues it from its checkpoint at step {at}" in failed["error"]

    r = d.http.post(f"/jobs/{job['id']}/resume")
    assert r.status_code == 202, r.text
    final = d.wait_terminal(job["id"])
    assert final["state"] == "SUCCEEDED", final
    events = d.events(job["id"])
    assert step_numbers(events) == list(range(1, CRASHER_STEPS + 1))
    last = [e for e in events if e["kind"] == "resumed"][-1]
    assert last["reason"] == "resume requested" and last["step"] == at
    assert step_numbers(events[events.index(last) :])[0] == at + 1
    assert _states(d, job["id"]) == ["PENDING", "RUNNING", "FAILED", "PENDING", "RUNNING", "SUCCEEDED"]
