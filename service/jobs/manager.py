"""The job queue: FIFO, one job at a time owns the engine, persisted in the store.

JobManager answers the API's requests about jobs (submit, cancel, resume) from the HTTP threads;
the thread that runs the jobs is its base, service.jobs.worker.JobWorker. Before it takes a job,
the worker removes what interrupted checkpoint writes left in the output directories of the
store's jobs (service.jobs.sweep). A store that cannot write answers requests with 503.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from dflash_core.kinds import kind, kind_of_spec

from ..config import MAX_CRASH_RESUMES
from .admission import job_to_json
from .by_kind import spec_kind, to_engine_job
from .errors import JobConflict, JobNotFound, Unavailable
from .records import Ingest
from .schemas import SpecError, SpecModel
from .store import FAILED, PENDING, STOPPED, TERMINAL, JobRecord, OutputDirInUse, StoreUnavailable, SubmissionConflict
from .worker import JobWorker

__all__ = ["MAX_CRASH_RESUMES", "JobConflict", "JobManager", "JobNotFound", "Unavailable"]

log = logging.getLogger("dflash.jobs")

# A submission that arrives while torch is still being imported waits this long for the engine object
# (it validates shapes against it); importing takes seconds, not minutes.
ENGINE_CREATE_TIMEOUT = 120.0


class JobManager(JobWorker):
    """The queue's requests, answered from the HTTP threads (the thread that runs the jobs is the
    base class's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ingest = Ingest(self)  # records sent to running continual jobs

    def submit(self, spec: SpecModel) -> tuple[JobRecord, bool]:
        """Queue a job. Returns (job, created). Raises SpecError (422), SubmissionConflict/JobConflict (409),
        Unavailable (503)."""
        try:
            return self._submit(spec)
        except StoreUnavailable as e:
            raise Unavailable(f"{e}; submit again once it can") from None

    def _submit(self, spec: SpecModel) -> tuple[JobRecord, bool]:
        from dflash_core.engine import JobError

        fingerprint = spec.fingerprint()
        if spec.submission_id is not None:
            existing = self.store.find_by_submission(spec.submission_id)
            if existing is not None:
                if existing.spec_fingerprint != fingerprint:
                    raise SubmissionConflict(existing)
                return existing, False
        if self.shutting_down:
            raise Unavailable("the daemon is shutting down; submit again after it restarted")
        if self.host.failed:
            raise Unavailable(f"the engine failed to start ({self.host.error}); fix the daemon's config and restart it")
        # first: a store that cannot write is the answer whatever the spec says (a full data
        # directory would otherwise also fail the output_dir checks below, as the client's error)
        self.store.check_writable()
        engine = self.host.wait_engine(ENGINE_CREATE_TIMEOUT)
        if engine is None:
            raise Unavailable(
                (self.host.error and f"the engine failed to start ({self.host.error})")
                or "the engine is still starting; try again in a moment"
            )
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        engine_job = to_engine_job(spec, job_id, self.roots, self._job_output)
        try:
            engine.validate_job(engine_job)
        except JobError as e:
            raise SpecError(e.field or "spec", e.message) from None
        out = engine_job.output_dir
        # messages name the output_dir as the client gave it, not where it resolves
        given = _given_output_dir(spec.model_dump())
        self._check_output_dir_free(out, given, fresh=kind(spec_kind(spec)).resumes_from_output)
        try:  # the store decides: a submission for the same output_dir may have been accepted since the check
            job, created = self.store.create_job(
                job_id=job_id,
                name=spec.name,
                submission_id=spec.submission_id,
                spec=spec.model_dump(mode="json"),
                fingerprint=fingerprint,
                train_job_json=job_to_json(engine_job),
                output_dir=out,
            )
        except OutputDirInUse as e:
            raise _output_dir_taken(given, e.owner) from None
        if created:
            log.info("job queued", extra={"fields": {"job": job.id, "name": job.name, "output_dir": out}})
            with self._wake:
                self._wake.notify_all()
        return job, created

    def _job_output(self, job_id: str) -> tuple[str, str, str] | None:
        """(kind, state, output_dir) of a stored job (a job:// dataset), None if unknown."""
        job = self.store.get_job(job_id, with_checkpoints=False)
        return None if job is None else (job.spec.get("kind", "train"), job.state, job.output_dir)

    def _check_output_dir_free(self, output_dir: str, given: str, *, fresh: bool = False) -> None:
        """No other job owns it (the store decides again, atomically, when it records the job) and
        no earlier run left checkpoints in it. fresh: the job's kind continues from whatever its
        output directory holds (a regeneration's shards and manifest) and sweeps its leftovers, so
        it starts in a new or empty directory, or in one an earlier job of this daemon had (and gave
        up, or the check above refused it): files of the user's there would be overwritten, deleted
        or read as its own."""
        other = self.store.any_job_using(output_dir)
        # one that ended before it wrote a checkpoint (or a shard) gives the directory up
        if other is not None and not (other.state in (FAILED, STOPPED) and not self.store.checkpoints(other.id)):
            raise _output_dir_taken(given, other)
        if (other := self.store.job_nesting_with(output_dir)) is not None:
            raise JobConflict(
                f"output_dir {given} and the output_dir of job {other.id} ({other.state}) lie one inside the "
                "other; choose an output_dir outside every other job's"
            )
        checkpoints = Path(output_dir) / "checkpoints"
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise JobConflict(f"output_dir {given} already holds checkpoints; choose another output_dir")
        if fresh and Path(output_dir).is_dir() and not self.store.was_output_dir(output_dir):
            try:
                held = sum(1 for _ in Path(output_dir).iterdir())
            except OSError as e:
                raise JobConflict(f"output_dir {given} cannot be listed ({e.strerror or e})") from None
            if held:  # counted, not named: the names are not the client's to read
                raise JobConflict(
                    f"output_dir {given} already holds files ({held} entries); this kind of job writes into a new "
                    "or empty directory, where nothing of yours would be overwritten or read as its own"
                )

    def cancel(self, job_id: str) -> JobRecord:
        """Raises JobNotFound (404), JobConflict (409), Unavailable (503)."""
        try:
            return self._cancel(job_id)
        except StoreUnavailable as e:
            raise Unavailable(f"{e}; cancel again once it can") from None

    def _cancel(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id, with_checkpoints=False)
        if job is None:
            raise JobNotFound(job_id)
        if job.state in TERMINAL:
            raise JobConflict(f"job {job_id} already ended ({job.state}); nothing to cancel")
        if job.state == PENDING and self.store.stop_if_pending(job_id):
            log.info("queued job cancelled", extra={"fields": {"job": job_id}})
            return self._job(job_id)
        # RUNNING (or it started a moment ago): the engine stops it between two steps, after a checkpoint
        if not self.store.request_cancel(job_id):  # it ended in the meantime
            job = self._job(job_id, with_checkpoints=False)
            raise JobConflict(f"job {job_id} already ended ({job.state}); nothing to cancel")
        with self._current_lock:
            current = self._current
            held = current is not None and current.job_id == job_id
            if current is not None and held:
                current.cancel.set()
        if not held and self.host.failed and self.store.stop_running(job_id):
            # left RUNNING by an earlier process and no engine will ever pick it up in this one
            log.info("cancelled a running job no engine holds", extra={"fields": {"job": job_id}})
            return self._job(job_id)
        log.info("cancel requested for running job", extra={"fields": {"job": job_id}})
        return self._job(job_id)

    def resume(self, job_id: str) -> JobRecord:
        """Put a FAILED or STOPPED job back in the queue; it resumes from its newest checkpoint, with
        optimizer state and data order, as after a restart (a regeneration: from the shards it
        wrote, none if it failed before the first). Raises JobNotFound (404), JobConflict (409:
        another state, a training job without a checkpoint), Unavailable (503)."""
        try:
            return self._resume(job_id)
        except StoreUnavailable as e:
            raise Unavailable(f"{e}; resume again once it can") from None

    def _resume(self, job_id: str) -> JobRecord:
        job = self._job(job_id, with_checkpoints=False)
        if job.state not in (FAILED, STOPPED):
            raise JobConflict(f"job {job_id} is {job.state}; only a FAILED or STOPPED job can be resumed")
        if not job.owns_output_dir:
            raise JobConflict(
                f"job {job_id} no longer owns output_dir {_given_output_dir(job.spec)} (another job has it); "
                "submit it again with another output_dir"
            )
        checkpoint_path, checkpoint_step = self._newest_checkpoint(job_id)
        # a regeneration resumes from the shards its manifest lists, however many (none included)
        if checkpoint_path is None and not kind_of_spec(job.spec).resumes_from_output:
            raise JobConflict(f"job {job_id} has no checkpoint to resume from; submit it again as a new job")
        if self.shutting_down:
            raise Unavailable("the daemon is shutting down; resume the job after it restarted")
        if self.host.failed:
            raise Unavailable(f"the engine failed to start ({self.host.error}); fix the daemon's config and restart it")
        if not self.store.requeue(job_id, job.state, checkpoint_path, checkpoint_step):
            state = self._job(job_id, with_checkpoints=False).state
            raise JobConflict(f"job {job_id} changed to {state} meanwhile; only a FAILED or STOPPED job can be resumed")
        log.info(
            "job put back in the queue; it resumes from its checkpoint",
            extra={"fields": {"job": job_id, "from_step": checkpoint_step, "checkpoint": checkpoint_path}},
        )
        with self._wake:
            self._wake.notify_all()
        return self._job(job_id)


def _given_output_dir(spec: dict[str, Any]) -> str:
    """A job's output_dir as its client gave it (messages never name where it resolves)."""
    given = spec.get("output_dir")
    return repr(given) if given is not None else "(the default)"


def _output_dir_taken(output_dir: str, owner: JobRecord) -> JobConflict:
    return JobConflict(
        f"output_dir {output_dir} belongs to job {owner.id} ({owner.state}); its checkpoints live "
        "there: choose another output_dir"
    )
