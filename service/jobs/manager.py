"""The job queue: FIFO, one job at a time owns the engine, persisted in the store.

A single worker thread takes the next job once the engine is warm (jobs may be submitted while it
warms). A job the store still marks RUNNING at start belonged to a process that died or was shut
down: it resumes from its newest checkpoint, its step events beyond that checkpoint are discarded
first (they are recomputed identically), and a `resumed` event records it. A FAILED or STOPPED job
put back in the queue through the API (`resume`) resumes the same way when its turn comes.

The worker outlives a store that cannot write (a full or failing disk under the data directory):
a job whose progress cannot be recorded stops, stays RUNNING and resumes from its last checkpoint
once the store writes again; an outcome that cannot be recorded is retried until it is; the worker
backs off meanwhile, and submissions are answered 503.

Before it takes a job, the worker removes what interrupted checkpoint writes left in the output
directories of the store's jobs (up to a whole checkpoint each), ended jobs' included; the engine
does the same in a job's directory whenever it runs the job, a resumed one included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tracking import Tracker
from .admission import job_from_json, job_to_json, to_engine_job
from .paths import Roots, given_paths, name_as_given
from .regenerate_spec import RegenerateSpec
from .schemas import JobSpec, SpecError
from .store import (
    FAILED,
    PENDING,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    TERMINAL,
    JobRecord,
    JobStore,
    OutputDirInUse,
    StoreUnavailable,
    SubmissionConflict,
)

if TYPE_CHECKING:
    from ..config import ServiceConfig
    from ..engine_host import EngineHost
    from ..metrics import ServiceMetrics

log = logging.getLogger("dflash.jobs")

# A job during which the daemon died more than this many times in a row without the job reaching a
# new checkpoint is failed instead of resumed again (a job that kills the process, e.g. through host
# OOM, would otherwise crash-loop the daemon forever); a crash after a new checkpoint does not count,
# since that job gets further each time.
MAX_CRASH_RESUMES = 5
# The worker's pauses while the store cannot write: doubling from the first to the last, and cut
# short by a submission (which shows the store writes again) or a shutdown.
STORE_RETRY_FIRST_SECONDS = 0.5
STORE_RETRY_MAX_SECONDS = 5.0
# What an interrupted checkpoint write leaves in <output_dir>/checkpoints (dflash_core.checkpoint
# writes into a temporary directory and swaps it in by renames), the names the engine's own sweep
# (dflash_core.engine.checkpointing.sweep_partial_writes) removes: never a checkpoint a resume reads
PARTIAL_CHECKPOINT_PREFIXES = (".tmp-step-", ".old-step-")
# the reason a job put back in the queue by resume() gives for its resume
RESUME_REQUESTED = "resume requested"
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

    def __init__(
        self, manager: JobManager, job_id: str, tracker: Tracker | None = None, paths: dict[str, str] | None = None
    ):
        self.manager = manager
        self.job_id = job_id
        self.tracker = tracker  # experiment tracking (report_to)
        self.paths = paths or {}  # the job's paths as the engine has them -> as the client gave them
        self.cancel = threading.Event()
        # the store's failure that ended the run (the engine reports any callback error as the job's)
        self.store_error: StoreUnavailable | None = None

    def _store(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A store call, whose failure is noted before it propagates through the engine."""
        try:
            return call(*args, **kwargs)
        except StoreUnavailable as e:
            self.store_error = e
            raise

    # The engine calls these from the job's thread; see dflash_core.engine.JobCallbacks.
    def on_step(self, stats) -> None:
        payload = dataclasses.asdict(stats)
        self._store(
            self.manager.store.update_progress,
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
        if self.tracker is not None:
            self.tracker.step(stats)
        log.debug("step", extra={"fields": {"job": self.job_id, "step": stats.step, "loss": round(stats.loss, 4)}})

    def on_checkpoint(self, path: str, step: int, pause_seconds: float = 0.0) -> None:
        self._store(self.manager.store.add_checkpoint, self.job_id, step, path, pause_seconds=pause_seconds)
        if self.manager.metrics is not None:
            self.manager.metrics.observe_checkpoint_pause(pause_seconds)
        if self.tracker is not None:
            self.tracker.checkpoint(step, pause_seconds)
        log.info("checkpoint written", extra={"fields": {"job": self.job_id, "step": step, "path": path}})

    def on_checkpoints_removed(self, paths: list[str]) -> None:
        self._store(self.manager.store.forget_checkpoints, self.job_id, paths)

    def on_event(self, kind: str, payload: dict) -> None:
        if kind == "resumed":  # the manager already recorded the resume, with why and from where
            return
        store = self.manager.store
        if kind == "data":
            self._store(store.set_phase, self.job_id, "training")
            if self.manager.metrics is not None:
                self.manager.metrics.observe_data_progress(None, self.job_id)
            if payload.get("total_steps"):
                self._store(store.set_total_steps, self.job_id, int(payload["total_steps"]))
        if kind in ("data", "skipped_lines") and self._store(store.events, self.job_id, kinds=[kind], limit=1):
            return  # a resumed run reads the same data again: the first record stands
        if kind == "skipped_lines":  # the records' places, named as the client named the datasets
            payload = {**payload, "first": [name_as_given(str(m), self.paths) for m in payload.get("first") or []]}
        self._store(store.add_event, self.job_id, kind, payload)

    def on_eval(self, step: int, result: dict) -> None:
        tau = result.get("acceptance_length")
        self._store(self.manager.store.set_eval, self.job_id, step, tau, {"step": step, **result})
        if self.manager.metrics is not None and tau is not None:
            self.manager.metrics.observe_eval(tau, self.job_id)
        if self.tracker is not None:
            self.tracker.eval(step, result)
        log.info("evaluation", extra={"fields": {"job": self.job_id, "step": step, "acceptance_length": tau}})

    def on_data_progress(self, progress: dict) -> None:
        if progress.get("rebuilt_cache_entries"):  # the datasets named as the client named them
            rebuilt = [
                {**r, "dataset": name_as_given(str(r["dataset"]), self.paths)}
                for r in progress["rebuilt_cache_entries"]
            ]
            progress = {**progress, "rebuilt_cache_entries": rebuilt}
        self._store(self.manager.store.set_phase, self.job_id, "preparing_data", progress)
        self._store(self.manager.store.add_event, self.job_id, "preparing_data", progress)
        if self.manager.metrics is not None:
            self.manager.metrics.observe_data_progress(progress, self.job_id)

    def on_generate(self, progress: dict) -> None:
        self._store(self.manager.store.update_generation, self.job_id, progress)
        if self.manager.metrics is not None:
            self.manager.metrics.observe_generate(progress, self.job_id)

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
            if losses > MAX_CRASH_RESUMES:
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

    # ------------------------------------------------------------------ requests
    def submit(self, spec: JobSpec | RegenerateSpec) -> tuple[JobRecord, bool]:
        """Queue a job. Returns (job, created). Raises SpecError (422), SubmissionConflict/JobConflict (409),
        Unavailable (503)."""
        try:
            return self._submit(spec)
        except StoreUnavailable as e:
            raise Unavailable(f"{e}; submit again once it can") from None

    def _submit(self, spec: JobSpec | RegenerateSpec) -> tuple[JobRecord, bool]:
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
        self._check_output_dir_free(out, given)
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

    def _check_output_dir_free(self, output_dir: str, given: str) -> None:
        """No other job owns it (the store decides again, atomically, when it records the job) and
        no earlier run left checkpoints in it."""
        if (other := self.store.any_job_using(output_dir)) is not None:
            raise _output_dir_taken(given, other)
        checkpoints = Path(output_dir) / "checkpoints"
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise JobConflict(f"output_dir {given} already holds checkpoints; choose another output_dir")

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
        optimizer state and data order, as after a restart. Raises JobNotFound (404), JobConflict
        (409: another state, no checkpoint), Unavailable (503)."""
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
                f"job {job_id} shares output_dir {_given_output_dir(job.spec)} with an earlier job, which keeps it; "
                "submit it again with another output_dir"
            )
        checkpoint_path, checkpoint_step = self._newest_checkpoint(job_id)
        if checkpoint_path is None:
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

    @property
    def job_running(self) -> bool:
        """A job is on the engine right now (its hand-off queues may hold micro-batches)."""
        with self._current_lock:
            return self._current is not None

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        self._sweep_all_partial_checkpoints()
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

    # ------------------------------------------------------------------ partial checkpoint writes
    def _sweep_all_partial_checkpoints(self) -> None:
        """Before any job runs (nothing writes a checkpoint yet): every output directory the store knows."""
        try:
            output_dirs = self.store.output_dirs()
        except StoreUnavailable as e:
            log.warning("could not list the jobs' output directories to sweep", extra={"fields": {"error": str(e)}})
            return
        for output_dir in output_dirs:
            self._sweep_partial_checkpoints(output_dir)

    def _sweep_partial_checkpoints(self, output_dir: str) -> list[str]:
        """Remove what interrupted checkpoint writes left in <output_dir>/checkpoints; only where
        that directory, symlinks resolved, lies under the configured output roots. Creates nothing
        (most jobs' directories are gone or were never made)."""
        directory = Path(output_dir) / "checkpoints"
        try:
            real = directory.resolve()
            if not self.roots.holds_output(real):
                return []
            with os.scandir(real) as it:
                partial = [
                    e for e in it if e.name.startswith(PARTIAL_CHECKPOINT_PREFIXES) and e.is_dir(follow_symlinks=False)
                ]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            log.warning(
                "could not sweep partial checkpoint writes",
                extra={"fields": {"directory": str(directory), "error": str(e)}},
            )
            return []
        removed, freed = [], 0
        for entry in partial:
            size = _tree_bytes(entry.path)
            try:
                shutil.rmtree(entry.path)
            except OSError as e:
                log.warning(
                    "could not remove a partial checkpoint write",
                    extra={"fields": {"path": entry.path, "error": str(e)}},
                )
                continue
            removed.append(entry.path)
            freed += size
        if removed:
            log.info(
                "removed partial checkpoint writes",
                extra={"fields": {"directory": str(real), "names": [Path(p).name for p in removed], "bytes": freed}},
            )
        return removed

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
        if crashes > MAX_CRASH_RESUMES:
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
        backends = job.spec.get("report_to")
        tracker = Tracker(
            list(self.config.report_to if backends is None else backends),
            job_id=job.id,
            name=job.name,
            output_dir=job.output_dir,
            spec=job.spec,
            roots=train_job.output_roots,
        )
        callbacks = _RunCallbacks(self, job.id, tracker, given_paths(job.spec, train_job, job.id))
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
        elif callbacks.cancel.is_set():
            if self._record(lambda: self.store.finish(job.id, STOPPED, payload={"reason": "cancelled", **summary})):
                log.info("job stopped (cancelled)", extra={"fields": {"job": job.id, **summary}})
        elif self._record(lambda: self.store.mark_interrupted(job.id, result.steps_done)):
            # stopped for shutdown: stays RUNNING in the store, resumes from this checkpoint next start
            log.info(
                "job checkpointed for shutdown; it resumes at the next start",
                extra={"fields": {"job": job.id, **summary}},
            )


def _given_output_dir(spec: dict[str, Any]) -> str:
    """A job's output_dir as its client gave it (messages never name where it resolves)."""
    given = spec.get("output_dir")
    return repr(given) if given is not None else "(the default)"


def _output_dir_taken(output_dir: str, owner: JobRecord) -> JobConflict:
    return JobConflict(
        f"output_dir {output_dir} belongs to job {owner.id} ({owner.state}); its checkpoints live "
        "there: choose another output_dir"
    )


def _tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (symlinks not followed)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile: nothing to count
                total += os.lstat(os.path.join(parent, name)).st_size
    return total
