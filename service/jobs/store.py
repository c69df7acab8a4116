"""Jobs, their events and checkpoints in one SQLite file (WAL) under the data directory.

Every write is its own committed transaction, so a SIGKILL loses at most the statement in flight;
the job runner's resume logic relies on that (the last recorded checkpoint is always complete,
step events beyond it are discarded before resuming).

A statement that fails for a reason outside the daemon's code (a full disk, an I/O error, a lock)
raises StoreUnavailable: it had no effect (its transaction is rolled back, the connection stays
usable) and the same call may succeed later. Any other error is a bug and propagates as it is.

One job owns each output directory, in any state (its checkpoints live there): a unique index over
the owners enforces it, so that concurrent submissions cannot both be accepted."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .store_lists import JobListing
from .store_schema import (
    FAILED,
    JOB_COLUMNS,
    PENDING,
    QUEUE_ORDER,
    REPORTED_PROGRESS,
    RUNNING,
    SCHEMA,
    STATES,
    STOPPED,
    SUCCEEDED,
    TERMINAL,
    EventRecord,
    JobRecord,
    OutputDirInUse,
    StoreUnavailable,
    SubmissionConflict,
    Transaction,
    insert_event,
    job_record,
    migrate,
    unavailable_error,
)

__all__ = [
    "FAILED",
    "PENDING",
    "REPORTED_PROGRESS",
    "RUNNING",
    "STATES",
    "STOPPED",
    "SUCCEEDED",
    "TERMINAL",
    "EventRecord",
    "JobRecord",
    "JobStore",
    "OutputDirInUse",
    "StoreUnavailable",
    "SubmissionConflict",
]


class JobStore(JobListing):
    """Thread-safe: one connection, one lock; every call is short."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a process crash loses no committed write
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        migrate(self._tx)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> Transaction:
        return Transaction(self._db, self._lock)

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """The connection for reads, under the store's lock."""
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as e:
                if (unavailable := unavailable_error(e, "read")) is not None:
                    raise unavailable from e
                raise

    def check_writable(self) -> None:
        """Raises StoreUnavailable when the store cannot commit a write now: a small committed
        write, since only a real one tells (SQLite reuses space it already holds)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO store_meta (key, value) VALUES ('write_check', ?)", (repr(time.time()),))

    # ------------------------------------------------------------------ jobs
    def create_job(
        self,
        *,
        job_id: str,
        name: str | None,
        submission_id: str | None,
        spec: dict[str, Any],
        fingerprint: str,
        train_job_json: str,
        output_dir: str,
    ) -> tuple[JobRecord, bool]:
        """Insert a PENDING job. Returns (job, created); an existing job with the same submission_id
        and fingerprint is returned with created=False; a different fingerprint raises SubmissionConflict;
        an output_dir that another job owns raises OutputDirInUse (one that FAILED or STOPPED before
        it wrote anything gives it up)."""
        now = time.time()
        with self._tx() as db:
            if submission_id is not None:
                existing = self._by_submission(db, submission_id)
                if existing is not None:
                    if existing.spec_fingerprint != fingerprint:
                        raise SubmissionConflict(existing)
                    return existing, False
            # an ended job that left nothing in its directory (no checkpoint, no shard) gives it up
            db.execute(
                "UPDATE jobs SET owns_output_dir = 0 WHERE output_dir = ? AND owns_output_dir = 1 AND state IN (?, ?)"
                " AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE checkpoints.job_id = jobs.id)",
                (output_dir, FAILED, STOPPED),
            )
            try:
                db.execute(
                    "INSERT INTO jobs (id, name, submission_id, spec_json, spec_fingerprint, train_job_json, output_dir, state, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job_id,
                        name,
                        submission_id,
                        json.dumps(spec),
                        fingerprint,
                        train_job_json,
                        output_dir,
                        PENDING,
                        now,
                    ),
                )
            except sqlite3.IntegrityError:
                owner = self._output_dir_owner(db, output_dir)
                if owner is None:
                    raise
                raise OutputDirInUse(owner) from None
            insert_event(db, job_id, "state", None, {"state": PENDING})
        job = self.get_job(job_id)
        assert job is not None  # inserted just above; jobs are never deleted
        return job, True

    def find_by_submission(self, submission_id: str) -> JobRecord | None:
        with self._read() as db:
            return self._by_submission(db, submission_id)

    def _by_submission(self, db, submission_id: str) -> JobRecord | None:
        row = db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE submission_id = ?", (submission_id,)).fetchone()
        return job_record(row) if row else None

    def get_job(self, job_id: str, *, with_checkpoints: bool = True) -> JobRecord | None:
        with self._read() as db:
            row = db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            job = job_record(row)
            if with_checkpoints:
                job.checkpoints = self.checkpoints(job_id)
            if job.state == PENDING:
                job.queue_position = db.execute(
                    f"SELECT COUNT(*) FROM jobs WHERE state = ? AND ({QUEUE_ORDER}) < "
                    f"(SELECT {QUEUE_ORDER} FROM jobs WHERE id = ?)",
                    (PENDING, job_id),
                ).fetchone()[0]
            return job

    def count_by_state(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        with self._read() as db:
            for state, n in db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
                counts[state] = n
        return counts

    def next_runnable(self) -> JobRecord | None:
        """A job left RUNNING by an earlier process comes first (it was already running), then PENDING
        in the queue's order (QUEUE_ORDER)."""
        with self._read() as db:
            row = db.execute(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN (?, ?) ORDER BY state = ? DESC, {QUEUE_ORDER} LIMIT 1",
                (RUNNING, PENDING, RUNNING),
            ).fetchone()
            return job_record(row) if row else None

    def mark_running(self, job_id: str) -> bool:
        """PENDING -> RUNNING; False if the job is no longer PENDING (cancelled a moment ago)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET state = ?, started_at = COALESCE(started_at, ?), interrupted_by_shutdown = 0,"
                " yielded = 0 WHERE id = ? AND state = ?",
                (RUNNING, time.time(), job_id, PENDING),
            )
            if cur.rowcount:
                insert_event(db, job_id, "state", None, {"state": RUNNING})
            return bool(cur.rowcount)

    def finish(
        self,
        job_id: str,
        state: str,
        *,
        error: str | None = None,
        payload: dict[str, Any] | None = None,
        resume_with_group: bool = False,
    ) -> None:
        """resume_with_group: a FAILED job that continues from its last checkpoint when the daemon
        (and with it its multi-host group) starts again (jobs_to_resume_with_group). The column
        counts such losses in a row that found no checkpoint newer than the run started from, so
        that a job which breaks its group every time is not started again forever."""
        assert state in TERMINAL
        again = bool(resume_with_group and state == FAILED)
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state = ?, finished_at = ?, error = COALESCE(?, error), resume_with_group = CASE "
                "WHEN NOT ? THEN 0 "
                "WHEN COALESCE(last_checkpoint_step, 0) > COALESCE(resume_step, 0) THEN 1 "
                "ELSE resume_with_group + 1 END WHERE id = ?",
                (state, time.time(), error, again, job_id),
            )
            body = {"state": state, **(payload or {})}
            if error:
                body["error"] = error
            insert_event(db, job_id, "state", None, body)

    def _stop_if(self, job_id: str, state: str, reason: str) -> bool:
        """state -> STOPPED atomically, with its event; False if the job is no longer in `state`."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET state = ?, finished_at = ?, cancel_requested = 1 WHERE id = ? AND state = ?",
                (STOPPED, time.time(), job_id, state),
            )
            if cur.rowcount:
                insert_event(db, job_id, "state", None, {"state": STOPPED, "reason": reason})
            return cur.rowcount == 1

    def stop_if_pending(self, job_id: str) -> bool:
        """A queued job that never ran."""
        return self._stop_if(job_id, PENDING, "cancelled before it started")

    def stop_running(self, job_id: str) -> bool:
        """A RUNNING job no worker holds (e.g. left RUNNING while the engine cannot start)."""
        return self._stop_if(job_id, RUNNING, "cancelled while no engine could run it")

    def request_cancel(self, job_id: str) -> bool:
        """Flag a RUNNING job for cancellation; False if it is not RUNNING (any more)."""
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND state = ?", (job_id, RUNNING))
            if cur.rowcount:
                insert_event(db, job_id, "cancel_requested", None, {})
            return bool(cur.rowcount)

    def requeue_yielded(self, job_id: str, step: int) -> bool:
        """RUNNING -> PENDING behind every other queued job, those that yielded before it included:
        it gave the devices to one of them and resumes from its checkpoint after them. False if it
        is no longer RUNNING."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET state = ?, yielded = (SELECT MAX(yielded) FROM jobs) + 1 WHERE id = ? AND state = ?",
                (PENDING, job_id, RUNNING),
            )
            if cur.rowcount:
                payload = {"state": PENDING, "reason": "yielded to a queued job; resumes after it", "step": step}
                insert_event(db, job_id, "state", None, payload)
            return bool(cur.rowcount)

    def set_published(self, job_id: str, published: dict[str, Any], payload: dict[str, Any]) -> None:
        """A continual job published a version: the job shows it, and a `publish` event says so."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET published_json = ? WHERE id = ?", (json.dumps(published), job_id))
            insert_event(db, job_id, "publish", payload.get("step"), payload)

    def mark_interrupted(self, job_id: str, step: int) -> None:
        """Graceful shutdown: the job stays RUNNING (resumable) with its checkpoint."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET interrupted_by_shutdown = 1 WHERE id = ?", (job_id,))
            insert_event(db, job_id, "interrupted", step, {"reason": "daemon shutting down", "step": step})

    # the columns a training step updates, each from the step's payload key of the same name
    STEP_COLUMNS = (
        "step",
        "total_steps",
        "loss",
        "tokens_per_second",
        "expected_acceptance_length",
        "learning_rate",
        "epoch",
    )

    def update_progress(self, job_id: str, step: dict[str, Any]) -> None:
        """A training step: the job's progress columns, and the step's event (`step`, the payload)."""
        assignments = ", ".join(f"{column} = ?" for column in self.STEP_COLUMNS)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*(step[c] for c in self.STEP_COLUMNS), job_id))
            insert_event(db, job_id, "step", step["step"], step)

    def update_generation(self, job_id: str, progress: dict[str, Any]) -> None:
        """A regeneration's progress: rows done of total as its step, the progress as its data."""
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET step = ?, total_steps = ?, tokens_per_second = ?, phase = 'generating', data_json = ?"
                " WHERE id = ?",
                (
                    int(progress["rows_done"]),
                    int(progress["rows_total"]),
                    progress.get("tokens_per_second"),
                    json.dumps(progress),
                    job_id,
                ),
            )
            insert_event(db, job_id, "generate", int(progress["rows_done"]), progress)

    def set_phase(self, job_id: str, phase: str, data: dict[str, Any] | None = None) -> None:
        """The running job's phase, with the data preparation's progress while it prepares."""
        with self._tx() as db:
            if data is None:
                db.execute("UPDATE jobs SET phase = ? WHERE id = ?", (phase, job_id))
            else:
                db.execute("UPDATE jobs SET phase = ?, data_json = ? WHERE id = ?", (phase, json.dumps(data), job_id))

    def set_total_steps(self, job_id: str, total_steps: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET total_steps = ? WHERE id = ?", (total_steps, job_id))

    def set_eval(self, job_id: str, step: int, acceptance_length: float | None, payload: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET eval_acceptance_length = ? WHERE id = ?", (acceptance_length, job_id))
            insert_event(db, job_id, "eval", step, payload)

    def add_checkpoint(self, job_id: str, step: int, path: str, *, pause_seconds: float | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, step, path, time) VALUES (?, ?, ?, ?)",
                (job_id, step, path, time.time()),
            )
            db.execute(
                "UPDATE jobs SET last_checkpoint = ?, last_checkpoint_step = ? WHERE id = ?", (path, step, job_id)
            )
            payload: dict[str, Any] = {"path": path, "step": step}
            if pause_seconds is not None:
                payload["pause_seconds"] = round(pause_seconds, 4)
            insert_event(db, job_id, "checkpoint", step, payload)

    def forget_checkpoints(self, job_id: str, paths: list[str]) -> None:
        """The engine rotated these checkpoint directories away."""
        with self._tx() as db:
            db.executemany("DELETE FROM checkpoints WHERE job_id = ? AND path = ?", [(job_id, p) for p in paths])

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        with self._read() as db:
            rows = db.execute("SELECT step, path, time FROM checkpoints WHERE job_id = ? ORDER BY step", (job_id,))
            return [{"step": s, "path": p, "time": t} for s, p, t in rows.fetchall()]

    def jobs_to_resume_with_group(self) -> list[tuple[str, int]]:
        """FAILED jobs whose multi-host group lost a rank, oldest first, with how many times in a
        row that happened without a new checkpoint."""
        with self._read() as db:
            rows = db.execute(
                "SELECT id, resume_with_group FROM jobs WHERE state = ? AND resume_with_group > 0 ORDER BY seq",
                (FAILED,),
            ).fetchall()
        return [(r[0], int(r[1])) for r in rows]

    def requeue(
        self,
        job_id: str,
        from_state: str,
        checkpoint_path: str | None,
        checkpoint_step: int,
        reason: str = "resume requested",
    ) -> bool:
        # (the group-loss count stays: finish() reads it if the group is lost again)
        """A FAILED or STOPPED job back to PENDING, asked for through the API: it keeps its id and its
        place in the submission order, and when it runs it resumes from its newest checkpoint (the
        worker tells it by its recorded checkpoints: a job that never ran has none). Clears the
        crash count: the request is the operator's decision to try again. False if the job is no
        longer in `from_state` or no longer owns its output_dir."""
        assert from_state in (FAILED, STOPPED)
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET state = ?, finished_at = NULL, error = NULL, cancel_requested = 0,"
                " interrupted_by_shutdown = 0, crash_resumes = 0, yielded = 0"
                " WHERE id = ? AND state = ? AND owns_output_dir = 1",
                (PENDING, job_id, from_state),
            )
            if cur.rowcount:
                payload = {
                    "state": PENDING,
                    "reason": reason,
                    "previous_state": from_state,
                    "checkpoint": checkpoint_path,
                    "checkpoint_step": checkpoint_step,
                }
                insert_event(db, job_id, "state", None, payload)
            return bool(cur.rowcount)

    def prepare_resume(
        self, job_id: str, checkpoint_path: str | None, checkpoint_step: int, *, after_crash: bool, reason: str
    ) -> int:
        """Roll the job back to `checkpoint_step`: delete its step/eval/checkpoint records beyond it (they are
        recomputed, identically, after the resume), count the crash (JobRecord.crashes_after) and record
        the resume with its reason, in one transaction. Returns the number of events removed."""
        with self._tx() as db:
            row = db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            job = job_record(row)
            removed = db.execute(
                "DELETE FROM events WHERE job_id = ? AND kind IN ('step', 'eval', 'checkpoint') AND step > ?",
                (job_id, checkpoint_step),
            ).rowcount
            db.execute("DELETE FROM checkpoints WHERE job_id = ? AND step > ?", (job_id, checkpoint_step))
            row = db.execute(
                "SELECT payload_json FROM events WHERE job_id = ? AND kind = 'step' AND step = ?"
                " ORDER BY id DESC LIMIT 1",
                (job_id, checkpoint_step),
            ).fetchone()
            last = json.loads(row[0]) if row else {}
            db.execute(
                "UPDATE jobs SET step = ?, loss = ?, tokens_per_second = ?, last_checkpoint = ?, last_checkpoint_step = ?,"
                " resumes = resumes + 1, crash_resumes = ?, resume_step = ?, interrupted_by_shutdown = 0 WHERE id = ?",
                (
                    checkpoint_step,
                    last.get("loss"),
                    last.get("tokens_per_second"),
                    checkpoint_path,
                    checkpoint_step if checkpoint_path else None,
                    job.crashes_after(checkpoint_step, after_crash=after_crash),
                    checkpoint_step,
                    job_id,
                ),
            )
            payload = {
                "step": checkpoint_step,
                "checkpoint": checkpoint_path,
                "reason": reason,
                "discarded_events": removed,
                "steps_lost": max(0, job.step - checkpoint_step),
            }
            insert_event(db, job_id, "resumed", checkpoint_step, payload)
        return removed

    # ------------------------------------------------------------------ events

    def add_event(self, job_id: str, kind: str, payload: dict[str, Any], step: int | None = None) -> None:
        with self._tx() as db:
            insert_event(db, job_id, kind, step, payload)

    def events(
        self, job_id: str, *, after: int = 0, kinds: Iterable[str] | None = None, limit: int = 1000
    ) -> list[EventRecord]:
        kinds = list(kinds or [])
        sql = "SELECT id, job_id, time, kind, step, payload_json FROM events WHERE job_id = ? AND id > ?"
        args: list[Any] = [job_id, after]
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += kinds
        sql += " ORDER BY id LIMIT ?"
        args.append(limit)
        with self._read() as db:
            rows = db.execute(sql, args).fetchall()
        return [EventRecord(i, j, t, k, s, json.loads(p)) for i, j, t, k, s, p in rows]
