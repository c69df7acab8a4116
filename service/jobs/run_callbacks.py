"""The engine's callbacks for one run of a job: persist its progress in the store, feed the
metrics and the experiment trackers, and answer whether it should stop."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..metrics import ServiceMetrics
from ..tracking import Tracker
from .paths import name_as_given
from .store import JobStore, StoreUnavailable

log = logging.getLogger("dflash.jobs")


class RunOwner(Protocol):
    """What a run's callbacks read of the worker that runs it (service.jobs.worker.JobWorker):
    the store its progress goes to, the metrics it feeds, and whether the daemon is stopping."""

    @property
    def store(self) -> JobStore: ...

    @property
    def metrics(self) -> ServiceMetrics | None: ...

    @property
    def shutting_down(self) -> bool: ...


class RunCallbacks:
    """Engine callbacks of one run: persist progress, feed metrics, answer cancellation."""

    def __init__(
        self, manager: RunOwner, job_id: str, tracker: Tracker | None = None, paths: dict[str, str] | None = None
    ):
        self.manager = manager
        self.job_id = job_id
        self.tracker = tracker  # experiment tracking (report_to)
        self.paths = paths or {}  # the job's paths as the engine has them -> as the client gave them
        self.cancel = threading.Event()
        # the store's failure that ended the run (the engine reports any callback error as the job's)
        self.store_error: StoreUnavailable | None = None
        # a continual job's records as its run last reported them (the ingest route's bound reads
        # it); None until the run's first report
        self.records: dict[str, Any] | None = None

    def _store(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A store call, whose failure is noted before it propagates through the engine."""
        try:
            return call(*args, **kwargs)
        except StoreUnavailable as e:
            self.store_error = e
            raise

    # The engine calls these from the job's thread; see dflash_core.engine.JobCallbacks.
    def on_step(self, stats) -> None:
        self._store(self.manager.store.update_progress, self.job_id, dataclasses.asdict(stats))
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
        if kind in ("skipped_lines", "skipped_records"):  # the records' places, named as the client named them
            payload = {**payload, "first": [name_as_given(str(m), self.paths) for m in payload.get("first") or []]}
        if kind == "source_created":
            payload = {**payload, "source": name_as_given(str(payload.get("source")), self.paths)}
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

    def on_records(self, progress: dict) -> None:
        ingested, pending = int(progress.get("ingested", 0)), int(progress.get("pending", 0))
        # lines read per spool file: the ingest route's bound on what is not trained yet
        self.records = {
            "ingested": ingested,
            "pending": pending,
            "spool_lines_read": dict(progress.get("spool_lines_read") or {}),
        }
        if self.manager.metrics is not None:
            self.manager.metrics.observe_records(ingested, pending, self.job_id)

    def on_publish(self, result: dict) -> None:
        """A publish decision: a new version is the job's `published` and a `publish` event; a
        candidate that did not win is a `publish_check` event."""
        payload = {k: name_as_given(v, self.paths) if isinstance(v, str) else v for k, v in result.items()}
        if result.get("published"):
            published = {"version": result["version"], "tau": result["tau"], "path": payload["path"]}
            self._store(self.manager.store.set_published, self.job_id, published, payload)
            log.info("published", extra={"fields": {"job": self.job_id, **published}})
        else:
            self._store(self.manager.store.add_event, self.job_id, "publish_check", payload, result.get("step"))
        if self.manager.metrics is not None:
            self.manager.metrics.observe_publish(result, self.job_id)

    def on_target_swap(self, result: dict) -> None:
        payload = {k: name_as_given(v, self.paths) if isinstance(v, str) else v for k, v in result.items()}
        self._store(self.manager.store.add_event, self.job_id, "target_swap", payload, result.get("step"))
        if self.manager.metrics is not None and not result.get("refused"):
            self.manager.metrics.observe_target_swap(float(result["seconds"]), self.job_id)

    def should_cancel(self) -> bool:
        return self.cancel.is_set() or self.manager.shutting_down

    def should_yield(self) -> bool:
        return self._store(self.manager.store.count_by_state)["PENDING"] > 0
