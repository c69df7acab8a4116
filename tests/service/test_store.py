"""The job store on a real SQLite file: checkpoint records follow what the engine reports, the
crash-loop count, one job per output_dir (and the migration that brings an older database there),
putting an ended job back in the queue, and a full disk."""

import errno
import json
import os
import sqlite3

import pytest

from service.jobs.store import JobStore
from tests.helpers import mount_tmpfs, unmount


def test_rotated_checkpoints_are_forgotten_and_the_newest_stays(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(
        job_id="job-1",
        name=None,
        submission_id=None,
        spec={},
        fingerprint="f",
        train_job_json="{}",
        output_dir=str(tmp_path / "out"),
    )
    for step in (10, 20, 30):
        store.add_checkpoint("job-1", step, str(tmp_path / "out" / "checkpoints" / f"step-{step:08d}"))
    store.forget_checkpoints("job-1", [str(tmp_path / "out" / "checkpoints" / "step-00000010")])
    assert [c["step"] for c in store.checkpoints("job-1")] == [20, 30]
    job = store.get_job("job-1")
    assert job.last_checkpoint.endswith("step-00000030") and [c["step"] for c in job.checkpoints] == [20, 30]


def _job(store: JobStore, job_id: str, output_dir: str) -> None:
    store.create_job(
        job_id=job_id,
        name=None,
        submission_id=None,
        spec={},
        fingerprint="f",
        train_job_json="{}",
        output_dir=output_dir,
    )


def _crash_resume(store: JobStore, job_id: str, step: int) -> int:
    """What the job worker does after a crash: resume from the newest checkpoint; the crash count."""
    store.prepare_resume(job_id, f"/ckpt/step-{step:08d}" if step else None, step, after_crash=True, reason="crash")
    job = store.get_job(job_id)
    assert job is not None
    return job.crash_resumes


def test_crashes_count_in_a_row_only_without_a_new_checkpoint(tmp_path):
    """The crash-loop guard counts crashes after which the job resumes from the checkpoint its last
    run started from; a crash after a new checkpoint resets the count, so a job that gets further
    every time is resumed any number of times. The count lives in the file across reopenings."""
    from service.jobs.manager import MAX_CRASH_RESUMES

    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    _job(store, "job-1", str(tmp_path / "out"))
    assert _crash_resume(store, "job-1", 0) == 1  # died before its first checkpoint
    store.add_checkpoint("job-1", 10, "/ckpt/step-00000010")
    assert _crash_resume(store, "job-1", 10) == 0  # it got further: progress resets
    for crash in range(1, 2 * MAX_CRASH_RESUMES):  # died again and again before step 20
        assert _crash_resume(store, "job-1", 10) == crash
    store.add_checkpoint("job-1", 20, "/ckpt/step-00000020")
    assert _crash_resume(store, "job-1", 20) == 0

    # more crashes than the guard allows, each after a new checkpoint: never counted
    for step in range(30, 30 + 10 * (MAX_CRASH_RESUMES + 2), 10):
        store.add_checkpoint("job-1", step, f"/ckpt/step-{step:08d}")
        job = store.get_job("job-1")
        assert job is not None and job.crashes_after(step, after_crash=True) == 0 <= MAX_CRASH_RESUMES
        assert _crash_resume(store, "job-1", step) == 0

    # a resume that follows no crash (shutdown, store failure, request) neither counts nor resets
    _crash_resume(store, "job-1", step)
    store.prepare_resume("job-1", f"/ckpt/step-{step:08d}", step, after_crash=False, reason="the daemon was shut down")
    store.close()
    reopened = JobStore(path)
    job = reopened.get_job("job-1")
    assert job is not None and job.crash_resumes == 1 and job.resume_step == step
    assert job.crashes_after(step, after_crash=True) == 2
    resumed = reopened.events("job-1", kinds=["resumed"])
    assert resumed[-1].payload["reason"] == "the daemon was shut down" and resumed[-1].step == step


def test_one_job_owns_an_output_dir_in_any_state(tmp_path):
    from service.jobs.store import FAILED, OutputDirInUse

    store = JobStore(tmp_path / "jobs.sqlite3")
    out = str(tmp_path / "out")
    _job(store, "job-1", out)
    store.add_checkpoint("job-1", 1, out + "/checkpoints/step-00000001")
    store.finish("job-1", FAILED, error="boom")  # an ended job keeps its checkpoints, so its directory
    with pytest.raises(OutputDirInUse) as e:
        _job(store, "job-2", out)
    assert e.value.owner.id == "job-1"
    assert store.get_job("job-2") is None and [j.id for j in store.list_jobs()] == ["job-1"]
    _job(store, "job-3", str(tmp_path / "other"))  # the failed insert left the store usable
    # one that ended before it wrote anything gives its directory up to the next job
    store.finish("job-3", FAILED, error="boom before the first checkpoint")
    _job(store, "job-4", str(tmp_path / "other"))
    owners = {j.id: j.owns_output_dir for j in store.list_jobs()}
    assert owners["job-3"] is False and owners["job-4"] is True


def _old_database(path) -> None:
    """A database as the release before unique output dirs wrote it: three jobs accepted
    concurrently for one output_dir, one of them running."""
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE jobs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, name TEXT, submission_id TEXT UNIQUE,
            spec_json TEXT NOT NULL, spec_fingerprint TEXT NOT NULL, train_job_json TEXT NOT NULL,
            output_dir TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL,
            finished_at REAL, step INTEGER NOT NULL DEFAULT 0, total_steps INTEGER, loss REAL,
            tokens_per_second REAL, expected_acceptance_length REAL, eval_acceptance_length REAL,
            learning_rate REAL, epoch REAL, last_checkpoint TEXT, last_checkpoint_step INTEGER, error TEXT,
            cancel_requested INTEGER NOT NULL DEFAULT 0, interrupted_by_shutdown INTEGER NOT NULL DEFAULT 0,
            resumes INTEGER NOT NULL DEFAULT 0, crash_resumes INTEGER NOT NULL DEFAULT 0, phase TEXT, data_json TEXT
        );
        CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL REFERENCES jobs(id), time REAL NOT NULL,
            kind TEXT NOT NULL, step INTEGER, payload_json TEXT NOT NULL
        );
        CREATE TABLE checkpoints (
            job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL, path TEXT NOT NULL, time REAL NOT NULL,
            PRIMARY KEY (job_id, step)
        );
        """
    )
    rows = [
        ("job-a", "/out/shared", "SUCCEEDED", 0),
        ("job-b", "/out/shared", "RUNNING", 4),  # lifetime crash count of the old guard
        ("job-c", "/out/shared", "PENDING", 0),
        ("job-d", "/out/own", "PENDING", 0),
    ]
    for job_id, out, state, crashes in rows:
        db.execute(
            "INSERT INTO jobs (id, spec_json, spec_fingerprint, train_job_json, output_dir, state, created_at,"
            " crash_resumes) VALUES (?, ?, 'f', '{}', ?, ?, 0, ?)",
            (job_id, json.dumps({"output_dir": out.removeprefix("/out/")}), out, state, crashes),
        )
    db.commit()
    db.close()


def test_migration_makes_output_dirs_unique(tmp_path):
    """An older database with jobs sharing an output_dir opens: the running job keeps the directory
    (its checkpoints are the live ones), a queued duplicate fails with a readable error instead of
    training into them, and the store refuses further duplicates."""
    from service.jobs.store import OutputDirInUse

    path = tmp_path / "jobs.sqlite3"
    _old_database(path)
    store = JobStore(path)
    jobs = {j.id: j for j in store.list_jobs()}
    assert {i: (j.state, j.owns_output_dir) for i, j in jobs.items()} == {
        "job-a": ("SUCCEEDED", False),
        "job-b": ("RUNNING", True),
        "job-c": ("FAILED", False),
        "job-d": ("PENDING", True),
    }
    assert "belongs to job job-b" in (jobs["job-c"].error or "")
    # named as its client gave it, not as the daemon resolved it (errors are readable by any reader)
    assert "output_dir 'shared'" in jobs["job-c"].error and "/out/" not in jobs["job-c"].error
    assert jobs["job-b"].crash_resumes == 0  # the old lifetime count says nothing about crashes in a row
    assert store.any_job_using("/out/shared").id == "job-b"
    with pytest.raises(OutputDirInUse):
        _job(store, "job-e", "/out/shared")
    store.close()
    JobStore(path).close()  # opening a migrated database again changes nothing


def test_requeue_puts_an_ended_job_back_with_an_event(tmp_path):
    from service.jobs.store import FAILED, PENDING, STOPPED

    store = JobStore(tmp_path / "jobs.sqlite3")
    _job(store, "job-1", str(tmp_path / "out"))
    assert not store.requeue("job-1", FAILED, "/ckpt/step-00000010", 10)  # PENDING: nothing to resume
    store.mark_running("job-1")
    store.request_cancel("job-1")
    store.finish("job-1", STOPPED)
    assert store.requeue("job-1", STOPPED, "/ckpt/step-00000010", 10)
    job = store.get_job("job-1")
    assert job is not None and job.state == PENDING and not job.cancel_requested and job.finished_at is None
    event = store.events("job-1", kinds=["state"])[-1]
    assert event.payload == {
        "state": PENDING,
        "reason": "resume requested",
        "previous_state": STOPPED,
        "checkpoint": "/ckpt/step-00000010",
        "checkpoint_step": 10,
    }
    assert not store.requeue("job-1", STOPPED, "/ckpt/step-00000010", 10)  # already back in the queue


def fill(path) -> None:
    """Write `path` until its file system has no space left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def test_a_full_disk_fails_writes_without_breaking_the_store(tmp_path):
    """On a full file system a write raises StoreUnavailable naming the cause, changes nothing,
    leaves no transaction open on the shared connection, and writes succeed once space is back."""
    from service.jobs.store import StoreUnavailable

    mount = tmp_path / "small"
    mount_tmpfs(mount, "size=2m")
    try:
        store = JobStore(mount / "jobs.sqlite3")
        _job(store, "job-1", "/out/1")
        fill(mount / "filler")
        with pytest.raises(StoreUnavailable, match="the job store cannot write: database or disk is full"):
            for step in range(1, 200):  # until the space SQLite held already is used up
                store.add_checkpoint("job-1", step, f"/ckpt/step-{step:08d}")
        with pytest.raises(StoreUnavailable):
            store.check_writable()
        failed_at = len(store.checkpoints("job-1")) + 1
        # reads work, and the failed write left nothing behind
        assert [c["step"] for c in store.checkpoints("job-1")] == list(range(1, failed_at))
        assert store.get_job("job-1").last_checkpoint_step == (failed_at - 1 or None)
        (mount / "filler").unlink()
        store.check_writable()
        store.add_checkpoint("job-1", failed_at, "/ckpt/again")
        assert store.get_job("job-1").last_checkpoint == "/ckpt/again"
        store.close()
    finally:
        unmount(mount)


def test_the_data_dir_lock_is_not_inherited_by_child_processes(tmp_path):
    """The lock's descriptor is close-on-exec: compile and tokenizer workers the daemon starts do
    not keep the data directory locked after the daemon has gone."""
    import fcntl

    from service.daemon import DataDirInUse, DataDirLock

    lock = DataDirLock(tmp_path)
    lock.acquire()
    try:
        assert lock._fd is not None and fcntl.fcntl(lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        other = DataDirLock(tmp_path)
        try:
            other.acquire()
            raise AssertionError("a second lock on the same data dir was granted")
        except DataDirInUse:
            pass
    finally:
        lock.release()


def test_a_yielded_job_queues_behind_the_others_and_shows_what_it_published(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    for job_id in ("job-continual", "job-a", "job-b"):
        _job(store, job_id, str(tmp_path / job_id))
    assert store.mark_running("job-continual")
    assert store.requeue_yielded("job-continual", step=40)
    assert not store.requeue_yielded("job-continual", step=40)  # no longer RUNNING
    order = []
    while (job := store.next_runnable()) is not None:
        order.append(job.id)
        store.mark_running(job.id)
        store.finish(job.id, "SUCCEEDED")
    assert order == ["job-a", "job-b", "job-continual"]  # then it runs again, no longer behind
    store.set_published("job-continual", {"version": 2, "tau": 3.1, "path": "p/v000002"}, {"step": 40, "version": 2})
    assert store.get_job("job-continual").published == {"version": 2, "tau": 3.1, "path": "p/v000002"}
    assert store.events("job-continual", kinds=["publish"])[0].payload["version"] == 2


def test_jobs_that_yield_in_turn_take_turns_and_their_positions_say_so(tmp_path):
    """Continual jobs that each yield at their checkpoints while the others wait: each turn goes to
    the job that has waited longest, and the positions shown are the order the queue runs."""
    store = JobStore(tmp_path / "jobs.sqlite3")
    ids = ["job-a", "job-b", "job-c"]
    for job_id in ids:
        _job(store, job_id, str(tmp_path / job_id))
    turns = []
    for _ in range(7):
        pending = [j for j in store.jobs_by_id(ids) if j.state == "PENDING"]
        shown = [j.id for j in sorted(pending, key=lambda j: j.queue_position)]
        assert [store.get_job(j).queue_position for j in shown] == list(range(len(shown)))
        job = store.next_runnable()
        assert job is not None and job.id == shown[0]
        assert store.mark_running(job.id)
        turns.append(job.id)
        assert store.requeue_yielded(job.id, step=10 * len(turns))
    assert turns == ["job-a", "job-b", "job-c", "job-a", "job-b", "job-c", "job-a"]
    # a job submitted now has not had a turn: it comes before those that yielded
    _job(store, "job-d", str(tmp_path / "job-d"))
    assert store.next_runnable().id == "job-d"
    assert store.get_job("job-d").queue_position == 0
    assert store.get_job("job-a").queue_position == 3  # yielded last
