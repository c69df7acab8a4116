"""The job worker: one thread that takes the queue's next job once the engine is warm, runs it on
the engine, and records how it ended.

A job the store still marks RUNNING at start belonged to a process that died or was shut down: it
resumes from its newest checkpoint, its step events beyond that checkpoint are discarded first
(they are recomputed identically), and a `resumed` event records it. A FAILED or STOPPED job put
back in the queue through the API (`resume`) resumes the same way when its turn comes.

The worker outlives a store that cannot write (a full or failing disk under the data directory):
a job whose progress cannot be recorded stops, stays RUNNING and resumes from its last checkpoint
once the store writes again; an outcome that cannot be recorded is retried until it is; the worker
backs off meanwhile.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_core.kinds import kind_of_spec

from ..tracking import Tracker
from .admission import job_from_json, with_roots_now
from .errors import JobNotFound
from .paths import Roots, given_paths, name_as_given
from .run_callbacks import RunCallbacks
from .schemas import SpecError
from .store import FAILED, PENDING, RUNNING, STOPPED, SUCCEEDED, TERMINAL, JobRecord, JobStore, StoreUnavailable
from .sweep import sweep_all_partial_checkpoints

if TYPE_CHECKING:
    from ..config import ServiceConfig
    from ..engine_host import EngineHost
    from ..metrics import ServiceMetrics

log = logging.getLogger("dflash.jobs")

# The worker's pauses while the store cannot write: doubling from the first to the last, and cut
# short by a submission (which shows the store writes again) or a shutdown.
STORE_RETRY_FIRST_SECONDS = 0.5
STORE_RETRY_MAX_SECONDS = 5.0
# the reason a job put back in the queue by resume() gives for its resume
RESUME_REQUESTED = "resume requested"
YIELDED = "YIELDED"  # a run's result: it gave the devices to a queued job (engine JobResult.status)


class JobWorker:
    """The queue's worker thread and the state it shares with the requests: the store, the engine
    host, the run in progress, the wake-up for a new job, the shutdown."""

    def __init__(self, config: ServiceConfig, store: JobStore, host: EngineHost):
        self.config = config
        self.store = store
        self.host = host
        self.metrics: ServiceMetrics | None = None  # set by the app once the metrics exist
        self._wake = threading.Condition()
        self._shutdown = threading.Event()
        self._current: RunCallbacks | None = None
        self._current_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.roots = Roots.of(config)
        # why a job this process stopped (the store could not write) or requeued resumes: it is not
        # a crash. Worker thread only.
        self._resume_notes: dict[str, str] = {}
        self._store_error: str | None = None  # the store's last failure, until a write succeeds again
        self._retry_seconds = STORE_RETRY_FIRST_SECONDS

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for job_id, losses in self.store.jobs_to_resume_with_group():
            # FAILED because the group lost a rank: this start is the group starting again
            if losses > self.config.max_crash_resumes:
                log.error(
                    "job lost its group %d times in a row without a new checkpoint; not resuming it again "
                    "(POST /jobs/{id}/resume does)",
                    losses,
                    extra={"fields": {"job": job_id}},
                )
                continue
            checkpoint_path, checkpoint_step = self._newest_checkpoint(job_id)
            if self.store.requeue(
                job_id, FAILED, checkpoint_path, checkpoint_step, reason="the multi-host group started again"
            ):
                log.info(
                    "job failed when its group lost a rank; it resumes once every rank is ready",
                    extra={"fields": {"job": job_id, "checkpoint": checkpoint_path}},
                )
        orphans = self.store.list_jobs(state=RUNNING, limit=100)
        for job in orphans:
            log.info(
                "job was running when the daemon stopped; it resumes once the engine is ready",
                extra={"fields": {"job": job.id, "step": job.step, "checkpoint": job.last_checkpoint}},
            )
        self._thread = threading.Thread(target=self._work, name="job-worker", daemon=True)
        self._thread.start()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown.is_set()

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_shutdown(self) -> None:
        """Ask the running job to checkpoint and stop (it stays resumable); returns at once."""
        if not self._shutdown.is_set():
            running = self.job_running
            log.info("shutdown requested" + (": the running job checkpoints and stays resumable" if running else ""))
        self._shutdown.set()
        with self._wake:
            self._wake.notify_all()

    def shutdown(self, timeout: float) -> None:
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error(
                    "the running job did not stop within the shutdown timeout", extra={"fields": {"seconds": timeout}}
                )

    def _newest_checkpoint(self, job_id: str) -> tuple[str | None, int]:
        """The job's newest recorded checkpoint that still exists (the engine rotates old ones away;
        a regeneration's are its shard files), else (None, 0)."""
        for ckpt in sorted(self.store.checkpoints(job_id), key=lambda c: c["step"], reverse=True):
            if Path(ckpt["path"]).exists():
                return ckpt["path"], int(ckpt["step"])
        return None, 0

    def _job(self, job_id: str, with_checkpoints: bool = True) -> JobRecord:
        """A job known to exist (the store never deletes jobs)."""
        job = self.store.get_job(job_id, with_checkpoints=with_checkpoints)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def records_of(self, job_id: str) -> dict[str, Any] | None:
        """A running continual job's records as its run last reported them; None before it did
        (a run that has not started yet, or is just starting)."""
        with self._current_lock:
            current = self._current
        if current is not None and current.job_id == job_id and current.records is not None:
            return dict(current.records)
        return None

    @property
    def job_running(self) -> bool:
        """A job is on the engine right now (its hand-off queues may hold micro-batches)."""
        with self._current_lock:
            return self._current is not None

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        sweep_all_partial_checkpoints(self.store, self.roots)
        while not self.shutting_down:
            try:
                self._work_once()
            except (StoreUnavailable, OSError) as e:  # a full or failing disk: the same work is tried again
                self._wait_for_store(e)
            except Exception:  # noqa: BLE001 - the worker must survive its own bugs too; logged, retried
                log.exception("job worker error")
                self._wait_for_store(None)

    def _work_once(self) -> None:
        if not self.host.can_train:
            if self.host.failed or self.host.ready:
                # failed: jobs stay queued for the next start; ready: warm, but a multi-host group is
                # not whole (ranks still warming, or one lost: queued jobs wait for the restart)
                self._shutdown.wait(1.0 if self.host.failed else 0.5)
            else:
                self.host.wait_finished(0.2)
            return
        job = self.store.next_runnable()
        if job is None:
            with self._wake:
                if not self.shutting_down:
                    self._wake.wait(1.0)
            return
        try:
            self._run(job)
        except (StoreUnavailable, OSError):
            raise
        except Exception:  # noqa: BLE001 - the worker must survive anything a job does
            log.exception("job runner error", extra={"fields": {"job": job.id}})
            self._record(
                lambda: self._fail_unless_ended(job.id, "internal error in the job runner; see the daemon log")
            )

    def _fail_unless_ended(self, job_id: str, error: str) -> None:
        current = self.store.get_job(job_id, with_checkpoints=False)
        if current is not None and current.state not in TERMINAL:
            self.store.finish(job_id, FAILED, error=error)

    def _wait_for_store(self, error: BaseException | None) -> bool:
        """Pause after a failed store call (which had no effect) before the worker tries again;
        False once the daemon shuts down."""
        if error is not None:
            reason = str(error) if isinstance(error, StoreUnavailable) else f"{type(error).__name__}: {error}"
            if self._store_error is None:
                log.error(
                    "the job store or the file system failed; jobs wait and the worker tries again",
                    extra={"fields": {"error": reason}},
                )
            else:
                log.debug("the job store still fails", extra={"fields": {"error": reason}})
            self._store_error = reason
        with self._wake:
            if not self.shutting_down:
                self._wake.wait(self._retry_seconds)
        self._retry_seconds = min(2 * self._retry_seconds, STORE_RETRY_MAX_SECONDS)
        return not self.shutting_down

    def _store_works(self) -> None:
        if self._store_error is not None:
            log.info("the job store writes again", extra={"fields": {"after": self._store_error}})
        self._store_error = None
        self._retry_seconds = STORE_RETRY_FIRST_SECONDS

    def _record(self, write: Callable[[], object]) -> bool:
        """A write that records what already happened (a job's end), retried until the store takes
        it. False if the daemon began shutting down first: the job then stays RUNNING in the store
        and, resumed at the next start, ends again the same way."""
        while True:
            try:
                write()
            except StoreUnavailable as e:
                if not self._wait_for_store(e):
                    return False
                continue
            self._store_works()
            return True

    # ------------------------------------------------------------------ running a job
    def _prepare_orphan(self, job: JobRecord) -> tuple[bool, str | None]:
        """A RUNNING job no run holds (left by an earlier process, stopped by a store failure, or
        requeued): returns (run it, resume_from)."""
        if job.cancel_requested:
            self.store.finish(
                job.id,
                STOPPED,
                payload={
                    "reason": "cancel was requested before the daemon stopped",
                    "steps_done": job.step,
                    "final_checkpoint": job.last_checkpoint,
                },
            )
            self._resume_notes.pop(job.id, None)
            return False, None
        note = self._resume_notes.get(job.id)
        after_crash = note is None and not job.interrupted_by_shutdown
        checkpoint_path, checkpoint_step = self._newest_checkpoint(job.id)
        crashes = job.crashes_after(checkpoint_step, after_crash=after_crash)
        if crashes > self.config.max_crash_resumes:
            then = (
                f"POST /jobs/{job.id}/resume continues it from its checkpoint at step {checkpoint_step}"
                if checkpoint_path
                else "it has no checkpoint: submit it again"
            )
            self.store.finish(
                job.id,
                FAILED,
                error=f"the daemon died {crashes} times in a row while running this job, without the job "
                f"reaching a new checkpoint; not resuming it again (see the daemon log); {then}",
            )
            return False, None
        reason = note or ("the daemon was killed or crashed" if after_crash else "the daemon was shut down")
        self.store.prepare_resume(job.id, checkpoint_path, checkpoint_step, after_crash=after_crash, reason=reason)
        self._resume_notes.pop(job.id, None)
        log.info(
            "resuming job",
            extra={
                "fields": {"job": job.id, "from_step": checkpoint_step, "checkpoint": checkpoint_path, "reason": reason}
            },
        )
        return True, checkpoint_path

    def _run(self, job: JobRecord) -> None:
        resume = running = job.state == RUNNING  # RUNNING when picked: no run of this process holds it
        try:
            if job.state == PENDING:
                # a job put back in the queue by resume() has checkpoints; one that never ran has none
                resume = bool(self.store.checkpoints(job.id))
                if not self.store.mark_running(job.id):
                    return
                running = True
                if resume:
                    self._resume_notes[job.id] = RESUME_REQUESTED
                    job = self._job(job.id, with_checkpoints=False)
                else:
                    log.info("job started", extra={"fields": {"job": job.id}})
            self._run_running(job, resume=resume)
        except (StoreUnavailable, OSError) as e:
            if running:  # it stays RUNNING in the store: resumed, not counted as a crash, once it writes again
                self._resume_notes.setdefault(job.id, f"the job store could not record its progress ({e})")
            raise

    def _run_running(self, job: JobRecord, *, resume: bool) -> None:
        from dflash_core.engine import JobError

        resume_from = None
        if resume:
            run, resume_from = self._prepare_orphan(job)
            if not run:
                return
        try:
            train_job = job_from_json(job.train_job_json)
        except (TypeError, ValueError) as e:
            unreadable = f"stored job cannot be read by this version: {e}"
            self._record(lambda: self.store.finish(job.id, FAILED, error=unreadable))
            return
        try:  # it runs, and resumes, under the roots configured now
            train_job = with_roots_now(train_job, job.spec, self.roots)
        except SpecError as e:
            outside = e.message
            self._record(lambda: self.store.finish(job.id, FAILED, error=outside))
            return
        backends = job.spec.get("report_to")
        if not kind_of_spec(job.spec).trains:  # it reports no training scalars: nothing to track
            backends = []
        tracker = Tracker(
            list(self.config.report_to if backends is None else backends),
            job_id=job.id,
            name=job.name,
            output_dir=job.output_dir,
            spec=job.spec,
            roots=train_job.output_roots,
        )
        callbacks = RunCallbacks(self, job.id, tracker, given_paths(job.spec, train_job, job.id))
        for refused in tracker.errors:  # said where the job's reader sees it, not only in the daemon's log
            payload = {**refused, "error": name_as_given(refused["error"], callbacks.paths)}
            self._record(functools.partial(self.store.add_event, job.id, "tracking", payload))
        with self._current_lock:
            self._current = callbacks
        if self.metrics is not None:  # the last job's series give way to this one's
            self.metrics.start_job(job.id)
        try:
            # a cancel that arrived between the queue pick and now
            if self._job(job.id, with_checkpoints=False).cancel_requested:
                callbacks.cancel.set()
            engine = self.host.engine
            assert engine is not None  # the worker runs jobs only once the engine is ready
            self._store_works()  # the job's first writes went through
            result = engine.run_job(train_job, callbacks, resume_from=resume_from)
        except JobError as e:
            if callbacks.store_error is not None:  # not the job's failure: its progress could not be recorded
                raise callbacks.store_error from e
            error = name_as_given(str(e), callbacks.paths)  # readable by anyone who may list the jobs
            again = e.resumable and not callbacks.cancel.is_set()  # a cancelled job stays ended
            if self._record(lambda: self.store.finish(job.id, FAILED, error=error, resume_with_group=again)):
                log.error("job failed", extra={"fields": {"job": job.id, "error": error, "resumes_with_group": again}})
            return
        finally:
            tracker.close()
            with self._current_lock:
                self._current = None
        summary = {
            "steps_done": result.steps_done,
            "total_steps": result.total_steps,
            "final_checkpoint": result.final_checkpoint,
            "eval_acceptance_length": (result.eval or {}).get("acceptance_length"),
            "skipped_lines": result.skipped_lines,
        }
        if result.status == SUCCEEDED:
            if self._record(lambda: self.store.finish(job.id, SUCCEEDED, payload=summary)):
                log.info("job succeeded", extra={"fields": {"job": job.id, **summary}})
        elif result.status == YIELDED:  # a continual job gave the devices to a queued one
            if self._record(lambda: self.store.requeue_yielded(job.id, result.steps_done)):
                log.info(
                    "job yielded to a queued job; it resumes after it", extra={"fields": {"job": job.id, **summary}}
                )
        elif callbacks.cancel.is_set():
            if self._record(lambda: self.store.finish(job.id, STOPPED, payload={"reason": "cancelled", **summary})):
                log.info("job stopped (cancelled)", extra={"fields": {"job": job.id, **summary}})
        elif self._record(lambda: self.store.mark_interrupted(job.id, result.steps_done)):
            # stopped for shutdown: stays RUNNING in the store, resumes from this checkpoint next start
            log.info(
                "job checkpointed for shutdown; it resumes at the next start",
                extra={"fields": {"job": job.id, **summary}},
            )
