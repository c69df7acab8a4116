"""The job store's tables, the records read from them, its errors, its transactions, and the
migration of a database an earlier release wrote (service.jobs.store holds the queries)."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dflash.jobs")

PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"
STATES = (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)
TERMINAL = frozenset({SUCCEEDED, FAILED, STOPPED})

log = logging.getLogger("dflash.jobs")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,         -- FIFO order
    id TEXT NOT NULL UNIQUE,
    name TEXT,
    submission_id TEXT UNIQUE,
    spec_json TEXT NOT NULL,
    spec_fingerprint TEXT NOT NULL,
    train_job_json TEXT NOT NULL,
    output_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER,
    loss REAL,
    tokens_per_second REAL,
    expected_acceptance_length REAL,
    eval_acceptance_length REAL,
    learning_rate REAL,
    epoch REAL,
    last_checkpoint TEXT,
    last_checkpoint_step INTEGER,
    error TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    interrupted_by_shutdown INTEGER NOT NULL DEFAULT 0,
    resumes INTEGER NOT NULL DEFAULT 0,
    crash_resumes INTEGER NOT NULL DEFAULT 0,      -- crashes in a row without a new checkpoint
    phase TEXT,
    data_json TEXT,
    resume_step INTEGER,                           -- the checkpoint step the current run started from
    owns_output_dir INTEGER NOT NULL DEFAULT 1,    -- 0: gave it up (ended having written nothing), or a duplicate from before output dirs were unique
    resume_with_group INTEGER NOT NULL DEFAULT 0,  -- group losses in a row without a new checkpoint
    yielded INTEGER NOT NULL DEFAULT 0,            -- 0, or the turn it yielded the devices in: queued behind the others (QUEUE_ORDER)
    published_json TEXT                            -- a continual job's newest published version
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, id);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS store_meta (
    key TEXT PRIMARY KEY,
    value TEXT
);
"""
# after the columns it names exist (an older database gets them at open)
OUTPUT_DIR_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS jobs_output_dir ON jobs(output_dir) WHERE owns_output_dir = 1"


# the record's fields that a job's progress shows as they are (its JSON and its documented shape)
REPORTED_PROGRESS = (
    "loss",
    "tokens_per_second",
    "expected_acceptance_length",
    "eval_acceptance_length",
    "learning_rate",
    "epoch",
    "last_checkpoint",
    "last_checkpoint_step",
)


@dataclass
class JobRecord:
    seq: int
    id: str
    name: str | None
    submission_id: str | None
    spec: dict[str, Any]
    spec_fingerprint: str
    train_job_json: str
    output_dir: str
    state: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    step: int
    total_steps: int | None
    loss: float | None
    tokens_per_second: float | None
    expected_acceptance_length: float | None
    eval_acceptance_length: float | None
    learning_rate: float | None
    epoch: float | None
    last_checkpoint: str | None
    last_checkpoint_step: int | None
    error: str | None
    cancel_requested: bool
    interrupted_by_shutdown: bool
    resumes: int
    crash_resumes: int
    phase: str | None  # preparing_data | training while RUNNING
    data: dict[str, Any] | None  # the last data preparation progress
    resume_step: int | None  # the checkpoint step the current run started from (None: step 0)
    owns_output_dir: bool
    published: dict[str, Any] | None = None  # a continual job's newest version: {version, tau, path}
    checkpoints: list[dict[str, Any]] | None = None  # loaded by get_job(with_checkpoints=True)
    queue_position: int | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def crashes_after(self, checkpoint_step: int, *, after_crash: bool) -> int:
        """The job's count of crashes in a row without progress once it resumes from
        `checkpoint_step`. A checkpoint past the step its last run started from is progress and
        resets the count; a crash without one adds one; a resume that follows no crash (a shutdown,
        a store that could not write, a request) leaves it as it is."""
        if checkpoint_step > (self.resume_step or 0):
            return 0
        return self.crash_resumes + (1 if after_crash else 0)


@dataclass
class EventRecord:
    id: int
    job_id: str
    time: float
    kind: str
    step: int | None
    payload: dict[str, Any]


class StoreUnavailable(Exception):
    """The store could not read or write for a reason outside the daemon (disk full, I/O error,
    lock): the call had no effect and may succeed when tried again."""


def _spec_output_dir(spec_json: str) -> str:
    """The output_dir of a stored spec as its client gave it."""
    try:
        given = json.loads(spec_json).get("output_dir")
    except (ValueError, AttributeError):
        given = None
    return repr(given) if isinstance(given, str) else "(the default)"


class OutputDirInUse(Exception):
    """Another job owns the output directory."""

    def __init__(self, owner: JobRecord):
        self.owner = owner
        super().__init__(f"output_dir {owner.output_dir} belongs to job {owner.id} ({owner.state})")


# SQLite's primary result codes for conditions of the file system or of other connections, not of
# the statement: SQLITE_BUSY, LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN, PROTOCOL
_TRANSIENT_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})


def unavailable_error(error: sqlite3.Error, action: str) -> StoreUnavailable | None:
    """StoreUnavailable for an error of the environment, None for one of the statement (a bug)."""
    code = getattr(error, "sqlite_errorcode", None)
    if isinstance(error, sqlite3.OperationalError) and code is not None and code & 0xFF in _TRANSIENT_CODES:
        return StoreUnavailable(f"the job store cannot {action}: {error}")
    return None


class SubmissionConflict(Exception):
    def __init__(self, existing: JobRecord):
        self.existing = existing
        super().__init__(
            f"submission_id {existing.submission_id!r} is already used by job {existing.id} with a different spec"
        )


# The queue's order, for the job it runs next and the positions it shows: PENDING jobs that never
# yielded in submission order, then those that did, the one that yielded last behind the others
# (jobs that yield in turn take turns)
QUEUE_ORDER = "yielded, seq"

JOB_COLUMNS = (
    "seq, id, name, submission_id, spec_json, spec_fingerprint, train_job_json, output_dir, state, created_at, "
    "started_at, finished_at, step, total_steps, loss, tokens_per_second, expected_acceptance_length, "
    "eval_acceptance_length, learning_rate, epoch, last_checkpoint, last_checkpoint_step, error, cancel_requested, "
    "interrupted_by_shutdown, resumes, crash_resumes, phase, data_json, resume_step, owns_output_dir, published_json"
)
_JOB_FIELDS = tuple(name.strip() for name in JOB_COLUMNS.split(","))
# columns added after the first release: (name, declaration), added to an older database at open
_ADDED_COLUMNS = (
    ("phase", "TEXT"),
    ("data_json", "TEXT"),
    ("resume_step", "INTEGER"),
    ("owns_output_dir", "INTEGER NOT NULL DEFAULT 1"),
    ("resume_with_group", "INTEGER NOT NULL DEFAULT 0"),
    ("yielded", "INTEGER NOT NULL DEFAULT 0"),
    ("published_json", "TEXT"),
)


def job_record(row: tuple) -> JobRecord:
    values = dict(zip(_JOB_FIELDS, row, strict=True))
    values["spec"] = json.loads(values.pop("spec_json"))
    data = values.pop("data_json")
    values["data"] = json.loads(data) if data else None
    published = values.pop("published_json")
    values["published"] = json.loads(published) if published else None
    for flag in ("cancel_requested", "interrupted_by_shutdown", "owns_output_dir"):
        values[flag] = bool(values[flag])
    return JobRecord(**values)


def insert_event(db: sqlite3.Connection, job_id: str, kind: str, step: int | None, payload: dict[str, Any]) -> None:
    db.execute(
        "INSERT INTO events (job_id, time, kind, step, payload_json) VALUES (?, ?, ?, ?, ?)",
        (job_id, time.time(), kind, step, json.dumps(payload, default=str)),
    )


def migrate(tx: Callable[[], AbstractContextManager[sqlite3.Connection]]) -> None:
    """Bring a database of an earlier release to this schema, in one transaction. Writes
    nothing when it is already there (a daemon restarted on a full disk still opens it)."""
    with tx() as db:
        have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        for name, decl in _ADDED_COLUMNS:
            if name not in have:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
        if "resume_step" not in have:
            # crash_resumes counted every crash of a job's life; it now counts crashes in a row
            # without progress, which those numbers cannot tell: start them afresh
            db.execute("UPDATE jobs SET crash_resumes = 0")
        indexed = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'jobs_output_dir'")
        if indexed.fetchone() is None:
            _disown_duplicate_output_dirs(db)
            db.execute(OUTPUT_DIR_INDEX)


def _disown_duplicate_output_dirs(db: sqlite3.Connection) -> None:
    """Concurrent submissions used to be able to share an output directory. Per directory the
    job whose checkpoints are live keeps it (the RUNNING one, else the first submitted); the
    others no longer own it, and those that have not ended fail: they would train into
    another job's checkpoints."""
    rows = db.execute(
        "SELECT id, output_dir, state, spec_json FROM jobs WHERE owns_output_dir = 1 "
        "ORDER BY output_dir, state = ? DESC, seq",
        (RUNNING,),
    ).fetchall()
    owners: dict[str, str] = {}
    for job_id, output_dir, state, spec_json in rows:
        owner = owners.setdefault(output_dir, job_id)
        if owner == job_id:
            continue
        db.execute("UPDATE jobs SET owns_output_dir = 0 WHERE id = ?", (job_id,))
        if state not in TERMINAL:
            given = _spec_output_dir(spec_json)  # as the client gave it: errors are readable by any reader
            error = (
                f"output_dir {given} belongs to job {owner}, accepted at the same time; "
                "submit this job again with another output_dir"
            )
            db.execute(
                "UPDATE jobs SET state = ?, finished_at = ?, error = ? WHERE id = ?",
                (FAILED, time.time(), error, job_id),
            )
            insert_event(db, job_id, "state", None, {"state": FAILED, "error": error})
        log.warning(
            "job shares its output_dir with an earlier job; the earlier job keeps it",
            extra={"fields": {"job": job_id, "owner": owner, "output_dir": output_dir, "state": state}},
        )


class Transaction:
    """BEGIN IMMEDIATE .. COMMIT under the store's lock; on any error the transaction is rolled
    back (the connection is shared: a transaction left open would fail every later one) and an
    error of the environment becomes StoreUnavailable."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock):
        self._db, self._lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            self._lock.release()
            if (unavailable := unavailable_error(e, "write")) is not None:
                raise unavailable from e
            raise
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is None:
                try:
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    exc = e
            if exc is not None:
                self._rollback()
                if isinstance(exc, sqlite3.Error) and (unavailable := unavailable_error(exc, "write")) is not None:
                    raise unavailable from exc
                if exc_type is None:  # the COMMIT itself failed for a reason of the statement
                    raise exc
        finally:
            self._lock.release()

    def _rollback(self) -> None:
        # SQLite may have rolled back already (it does on some SQLITE_FULL and I/O errors)
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("the job store could not roll back a failed transaction")
