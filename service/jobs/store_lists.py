"""The store's list reads (JobStore inherits them): the newest jobs with their queue positions,
the cheap version of each that lets a reader reuse what it rendered before, and which job owns or
nests with an output directory."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .store_schema import JOB_COLUMNS, PENDING, QUEUE_ORDER, JobRecord, job_record

# what changes in a job's row when anything the list shows of it changes, for a job that ended
# (a job that has not ended is read whole every time: its progress moves)
VERSION_COLUMNS = "state, finished_at, resumes, step, last_checkpoint_step, error IS NULL"


class JobListing:
    # the store's read connection (JobStore._read), which the queries below go through
    _read: Callable[[], AbstractContextManager[sqlite3.Connection]]

    def list_jobs(self, state: str | None = None, limit: int = 1000) -> list[JobRecord]:
        """The newest `limit` jobs (in that state), oldest first, with their queue positions."""
        where, args = ("WHERE state = ?", [state]) if state else ("", [])
        with self._read() as db:
            rows = db.execute(
                f"SELECT * FROM (SELECT {JOB_COLUMNS} FROM jobs {where} ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                (*args, limit),
            ).fetchall()
            position = self._queue_positions(db)
        jobs = [job_record(r) for r in rows]
        for job in jobs:
            job.queue_position = position.get(job.seq)
        return jobs

    def list_versions(self, state: str | None = None, limit: int = 1000) -> list[tuple[str, str, tuple[Any, ...]]]:
        """(id, state, version) of the jobs list_jobs would return, in its order: the version
        changes whenever what the list shows of an ended job does."""
        where, args = ("WHERE state = ?", [state]) if state else ("", [])
        with self._read() as db:
            rows = db.execute(
                f"SELECT * FROM (SELECT seq, id, {VERSION_COLUMNS} FROM jobs {where} ORDER BY seq DESC LIMIT ?) "
                "ORDER BY seq",
                (*args, limit),
            ).fetchall()
        return [(r[1], r[2], tuple(r[2:])) for r in rows]

    def jobs_by_id(self, ids: list[str]) -> Iterator[JobRecord]:
        """These jobs (those that exist), with their queue positions."""
        with self._read() as db:
            position = self._queue_positions(db)
            for start in range(0, len(ids), 500):  # SQLite bounds the parameters of one statement
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                for row in db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id IN ({marks})", chunk).fetchall():
                    job = job_record(row)
                    job.queue_position = position.get(job.seq)
                    yield job

    @staticmethod
    def _queue_positions(db: sqlite3.Connection) -> dict[int, int]:
        rows = db.execute(f"SELECT seq FROM jobs WHERE state = ? ORDER BY {QUEUE_ORDER}", (PENDING,))
        pending = [seq for (seq,) in rows]
        return {seq: i for i, seq in enumerate(pending)}

    # ------------------------------------------------------------------ output directories
    def output_dirs(self) -> list[str]:
        """Every job's output directory."""
        with self._read() as db:
            return [d for (d,) in db.execute("SELECT DISTINCT output_dir FROM jobs ORDER BY output_dir")]

    def was_output_dir(self, output_dir: str) -> bool:
        """Whether a job of this store had this output directory, owning it now or not."""
        with self._read() as db:
            return db.execute("SELECT 1 FROM jobs WHERE output_dir = ? LIMIT 1", (output_dir,)).fetchone() is not None

    def any_job_using(self, output_dir: str) -> JobRecord | None:
        """The job, in any state, that owns this output directory (its checkpoints live there)."""
        with self._read() as db:
            return self._output_dir_owner(db, output_dir)

    def job_nesting_with(self, output_dir: str) -> JobRecord | None:
        """A job whose output directory lies inside `output_dir` or holds it (not equal to it):
        two jobs' directories nested would write into, rotate and sweep each other's files."""
        inside = output_dir.rstrip("/") + "/"
        with self._read() as db:
            for row in db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE owns_output_dir = 1"):
                job = job_record(row)
                other = job.output_dir.rstrip("/") + "/"
                if other != inside and (other.startswith(inside) or inside.startswith(other)):
                    return job
        return None

    def _output_dir_owner(self, db: sqlite3.Connection, output_dir: str) -> JobRecord | None:
        row = db.execute(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE output_dir = ? AND owns_output_dir = 1", (output_dir,)
        ).fetchone()
        return job_record(row) if row else None
