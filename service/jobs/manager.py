"""The job queue: FIFO, one job at a time owns the engine, persisted in the store.

A single worker thread takes the next job once the engine is warm (jobs may be submitted while it
warms). A job the store still marks RUNNING at start belonged to a process that died or was shut
down: it resumes from its newest checkpoint, its step events beyond that checkpoint are discarded
first (they are recomputed identically), and a `resumed` event records it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from .schemas import JobSpec, SpecError, to_train_job, train_job_from_json, train_job_to_json
from .store import FAILED, PENDING, RUNNING, STOPPED, SUCCEEDED, TERMINAL, JobRecord, JobStore, SubmissionConflict

if TYPE_CHECKING:
    from ..config import ServiceConfig
    from ..engine_host import EngineHost
    from ..metrics import ServiceMetrics

log = logging.getLogger("dflash.jobs")

# A job during which the daemon died this many times is failed instead of resumed again (a job that
# kills the process, e.g. through host OOM, would otherwise crash-loop the daemon forever).
MAX_CRASH_RESUMES = 5
# A submission that arrives while torch is still being imported waits this long for the engine object
# (it validates shapes against it); importing takes seconds, not minutes.
ENGINE_CREATE_TIMEOUT = 120.0


class JobNotFound(KeyError):
    pass


class JobConflict(Exception):
    """The request conflicts with the job's state or with another job (HTTP 409)."""


class Unavailable(Exception):
    """The daemon cannot take the request now (HTTP 503)."""


class _RunCallbacks:
    """Engine callbacks of one run: persist progress, feed metrics, answer cancellation."""

    def __init__(self, manager: JobManager, job_id: str):
        self.manager = manager
        self.job_id = job_id
        self.cancel = threading.Event()

    # The engine calls these from the job's thread; see dflash_core.engine.JobCallbacks.
    def on_step(self, stats) -> None:
        payload = dataclasses.asdict(stats)
        self.manager.store.update_progress(
            self.job_id,
            step=stats.step,
            total_steps=stats.total_steps,
            loss=stats.loss,
            tokens_per_second=stats.tokens_per_second,
            expected_acceptance_length=stats.expected_acceptance_length,
            learning_rate=stats.learning_rate,
            epoch=stats.epoch,
            event_payload=payload,
        )
        if self.manager.metrics is not None:
            self.manager.metrics.observe_step(stats, self.job_id)
        log.debug("step", extra={"fields": {"job": self.job_id, "step": stats.step, "loss": round(stats.loss, 4)}})

    def on_checkpoint(self, path: str, step: int, pause_seconds: float = 0.0) -> None:
        self.manager.store.add_checkpoint(self.job_id, step, path, pause_seconds=pause_seconds)
        if self.manager.metrics is not None:
            self.manager.metrics.observe_checkpoint_pause(pause_seconds)
        log.info("checkpoint written", extra={"fields": {"job": self.job_id, "step": step, "path": path}})

    def on_checkpoints_removed(self, paths: list[str]) -> None:
        self.manager.store.forget_checkpoints(self.job_id, paths)

    def on_event(self, kind: str, payload: dict) -> None:
        if kind == "resumed":  # the manager already recorded the resume, with why and from where
            return
        if kind == "data":
            self.manager.store.set_phase(self.job_id, "training")
            if self.manager.metrics is not None:
                self.manager.metrics.observe_data_progress(None)
            if payload.get("total_steps"):
                self.manager.store.set_total_steps(self.job_id, int(payload["total_steps"]))
        if kind in ("data", "skipped_lines") and self.manager.store.events(self.job_id, kinds=[kind], limit=1):
            return  # a resumed run reads the same data again: the first record stands
        self.manager.store.add_event(self.job_id, kind, payload)

    def on_eval(self, step: int, result: dict) -> None:
        tau = result.get("acceptance_length")
        self.manager.store.set_eval(self.job_id, step, tau, {"step": step, **result})
        if self.manager.metrics is not None and tau is not None:
            self.manager.metrics.observe_eval(tau)
        log.info("evaluation", extra={"fields": {"job": self.job_id, "step": step, "acceptance_length": tau}})

    def on_data_progress(self, progress: dict) -> None:
        self.manager.store.set_phase(self.job_id, "preparing_data", progress)
        self.manager.store.add_event(self.job_id, "preparing_data", progress)
        if self.manager.metrics is not None:
            self.manager.metrics.observe_data_progress(progress)

    def should_cancel(self) -> bool:
        return self.cancel.is_set() or self.manager.shutting_down


class JobManager:
    def __init__(self, config: ServiceConfig, store: JobStore, host: EngineHost):
        self.config = config
        self.store = store
        self.host = host
        self.metrics: ServiceMetrics | None = None  # set by the app once the metrics exist
        self._wake = threading.Condition()
        self._shutdown = threading.Event()
        self._current: _RunCallbacks | None = None
        self._current_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dataset_roots = config.resolved_dataset_roots()
        self._output_roots = config.resolved_output_roots()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
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

    # ------------------------------------------------------------------ requests
    def submit(self, spec: JobSpec) -> tuple[JobRecord, bool]:
        """Queue a job. Returns (job, created). Raises SpecError (422), SubmissionConflict/JobConflict (409),
        Unavailable (503)."""
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
        engine = self.host.wait_engine(ENGINE_CREATE_TIMEOUT)
        if engine is None:
            raise Unavailable(
                (self.host.error and f"the engine failed to start ({self.host.error})")
                or "the engine is still starting; try again in a moment"
            )
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        train_job = to_train_job(
            spec,
            job_id=job_id,
            data_dir=self.config.data_dir,
            dataset_roots=self._dataset_roots,
            output_roots=self._output_roots,
        )
        self._validate_with_engine(engine, train_job)
        out = str(Path(train_job.output_dir))
        if (other := self.store.any_job_using(out)) is not None:
            raise JobConflict(
                f"output_dir {out} belongs to job {other.id} ({other.state}); its checkpoints live "
                "there: choose another output_dir"
            )
        if (Path(out) / "checkpoints").is_dir() and any((Path(out) / "checkpoints").iterdir()):
            raise JobConflict(f"output_dir {out} already holds checkpoints; choose another output_dir")
        job, created = self.store.create_job(
            job_id=job_id,
            name=spec.name,
            submission_id=spec.submission_id,
            spec=spec.model_dump(mode="json"),
            fingerprint=fingerprint,
            train_job_json=train_job_to_json(train_job),
            output_dir=out,
        )
        if created:
            log.info("job queued", extra={"fields": {"job": job.id, "name": job.name, "output_dir": out}})
            with self._wake:
                self._wake.notify_all()
        return job, created

    def _validate_with_engine(self, engine, train_job) -> None:
        from dflash_core.engine import JobError

        try:
            engine.validate_job(train_job)
        except JobError as e:
            raise SpecError(e.field or "spec", e.message) from None

    def cancel(self, job_id: str) -> JobRecord:
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

    def _job(self, job_id: str, with_checkpoints: bool = True) -> JobRecord:
        """A job known to exist (the store never deletes jobs)."""
        job = self.store.get_job(job_id, with_checkpoints=with_checkpoints)
        if job is None:
            raise JobNotFound(job_id)
        return job

    @property
    def job_running(self) -> bool:
        """A job is on the engine right now (its hand-off queues may hold micro-batches)."""
        with self._current_lock:
            return self._current is not None

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while not self.shutting_down:
            if not self.host.ready:
                if self.host.failed:  # jobs stay queued for the next start; nothing can run now
                    self._shutdown.wait(1.0)
                else:
                    self.host.wait_finished(0.2)
                continue
            job = self.store.next_runnable()
            if job is None:
                with self._wake:
                    if not self.shutting_down:
                        self._wake.wait(1.0)
                continue
            try:
                self._run(job)
            except Exception:  # noqa: BLE001 - the worker must survive anything a job does
                log.exception("job runner error", extra={"fields": {"job": job.id}})
                current = self.store.get_job(job.id, with_checkpoints=False)
                if current is not None and current.state not in TERMINAL:
                    self.store.finish(job.id, FAILED, error="internal error in the job runner; see the daemon log")

    def _prepare_orphan(self, job: JobRecord) -> tuple[bool, str | None]:
        """A job left RUNNING by an earlier process: returns (run it, resume_from)."""
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
            return False, None
        after_crash = not job.interrupted_by_shutdown
        if after_crash and job.crash_resumes >= MAX_CRASH_RESUMES:
            self.store.finish(
                job.id,
                FAILED,
                error=f"the daemon died {job.crash_resumes + 1} times while running this "
                "job; not resuming it again (see the daemon log)",
            )
            return False, None
        # the newest checkpoint that still exists (the engine rotates old ones away)
        checkpoint_path, checkpoint_step = None, 0
        for ckpt in sorted(self.store.checkpoints(job.id), key=lambda c: c["step"], reverse=True):
            if Path(ckpt["path"]).is_dir():
                checkpoint_path, checkpoint_step = ckpt["path"], int(ckpt["step"])
                break
        removed = self.store.prepare_resume(job.id, checkpoint_path, checkpoint_step, after_crash=after_crash)
        reason = "the daemon was killed or crashed" if after_crash else "the daemon was shut down"
        self.store.add_event(
            job.id,
            "resumed",
            {
                "step": checkpoint_step,
                "checkpoint": checkpoint_path,
                "reason": reason,
                "discarded_events": removed,
                "steps_lost": max(0, job.step - checkpoint_step),
            },
            step=checkpoint_step,
        )
        log.info(
            "resuming job",
            extra={
                "fields": {"job": job.id, "from_step": checkpoint_step, "checkpoint": checkpoint_path, "reason": reason}
            },
        )
        return True, checkpoint_path

    def _run(self, job: JobRecord) -> None:
        from dflash_core.engine import JobError

        resume_from = None
        if job.state == RUNNING:
            run, resume_from = self._prepare_orphan(job)
            if not run:
                return
        else:
            if not self.store.mark_running(job.id):
                return
            log.info("job started", extra={"fields": {"job": job.id}})
        try:
            train_job = train_job_from_json(job.train_job_json)
        except (TypeError, ValueError) as e:
            self.store.finish(job.id, FAILED, error=f"stored job cannot be read by this version: {e}")
            return
        callbacks = _RunCallbacks(self, job.id)
        with self._current_lock:
            self._current = callbacks
        # a cancel that arrived between the queue pick and now
        if self._job(job.id, with_checkpoints=False).cancel_requested:
            callbacks.cancel.set()
        engine = self.host.engine
        assert engine is not None  # the worker runs jobs only once the engine is ready
        try:
            result = engine.run_job(train_job, callbacks, resume_from=resume_from)
        except JobError as e:
            self.store.finish(job.id, FAILED, error=str(e))
            log.error("job failed", extra={"fields": {"job": job.id, "error": str(e)}})
            return
        finally:
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
            self.store.finish(job.id, SUCCEEDED, payload=summary)
            log.info("job succeeded", extra={"fields": {"job": job.id, **summary}})
        elif callbacks.cancel.is_set():
            self.store.finish(job.id, STOPPED, payload={"reason": "cancelled", **summary})
            log.info("job stopped (cancelled)", extra={"fields": {"job": job.id, **summary}})
        else:  # stopped for shutdown: stays RUNNING in the store, resumes from this checkpoint next start
            self.store.mark_interrupted(job.id, result.steps_done)
            log.info(
                "job checkpointed for shutdown; it resumes at the next start",
                extra={"fields": {"job": job.id, **summary}},
            )
