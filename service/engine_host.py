"""Owns the engine for the daemon: creates, builds and warms it in a background thread (so uvicorn
answers at once, even before torch is imported) and turns its progress into the /healthz body.

In a multi-host group the engine joins the group first; rank 0 is ready when every rank is, and
the other ranks, once warm, run the jobs rank 0 sends on a `follow` thread until rank 0 shuts the
group down or the group breaks (then `on_group_end` is called: the daemon exits, so that the
launcher or the orchestrator starts the group again)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_core.engine import Engine, EngineStatus, JobCallbacks
    from dflash_core.engine.launch import Launch

    from .config import ServiceConfig

log = logging.getLogger("dflash.engine")

STARTING, WARMING, READY, FAILED = "starting", "warming", "ready", "failed"

# A pause after each warm-up phase, read from the environment: it keeps the daemon observably
# warming for the tests of /healthz and of the container healthcheck. Not a setting of the daemon.
WARMUP_PAUSE_SECONDS = float(os.environ.get("DFLASH_TEST_WARMUP_PAUSE_SECONDS", "0") or 0)


class EngineHost:
    def __init__(
        self,
        config: ServiceConfig,
        launch: Launch | None = None,
        on_group_end: Callable[[str], None] | None = None,
        on_follower_step: Callable[[Any], None] | None = None,
    ):
        """launch: this process's place in a multi-host group (None: one process). Ranks other than
        0 call on_group_end(reason) when they stop following rank 0, and on_follower_step(stats)
        after each step of a job rank 0 sent (their metrics)."""
        self.config = config
        self.launch = launch
        self._on_group_end = on_group_end
        self._on_follower_step = on_follower_step
        self._stop_following = threading.Event()
        self.engine: Engine | None = None  # created by the build thread (importing torch takes seconds)
        # without explicit devices the embedded default uses exactly one drafter (cpu, cuda:0 or cuda:1)
        self.drafters_total = len(config.engine.drafter_devices) if config.engine.drafter_devices else 1
        self._started = time.monotonic()
        self._ready_after: float | None = None
        self._error: str | None = None
        self._created = threading.Event()
        self._ready = threading.Event()
        self._finished = threading.Event()  # ready or failed
        self._listeners: list[Callable[[Any], None]] = []
        self._thread: threading.Thread | None = None
        self._follow_thread: threading.Thread | None = None
        self._group_end: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def on_engine_created(self, listener: Callable[[Any], None]) -> None:
        """Call `listener(engine)` once the engine object exists (before it is built)."""
        self._listeners.append(listener)

    def start(self) -> None:
        # daemon: a build cannot be interrupted mid-torch-call; at exit the process must not wait on it
        self._thread = threading.Thread(target=self._build, name="engine-build", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            engine_config = self.config.engine
            from dflash_core.libraries import import_engine_libraries

            import_engine_libraries()  # torch, with the garbage collector paused (libraries.py)
            from dflash_core.engine import Engine

            group = None
            if self.launch is not None:
                from dflash_core.engine.distributed import RankGroup

                group = RankGroup(self.launch, self.config.distributed_timeout_seconds)
            created_after = time.monotonic() - self._started  # daemon start -> engine object (imports mostly)
            self.engine = engine = Engine(engine_config, self.config.data_dir, on_phase=self._on_phase, group=group)
            self.drafters_total = len(engine.drafter_devices)
            for listener in self._listeners:
                listener(engine)
            self._created.set()
            log.info(
                "engine build started",
                extra={
                    "fields": {
                        "target": str(engine_config.target_path or "embedded default"),
                        "drafter_devices": engine.drafter_devices,
                        "shape": dict(vars(engine_config.shape)),
                        **({"rank": self.launch.rank, "ranks": self.launch.world} if self.launch else {}),
                    }
                },
            )
            engine.build()
            if group is not None and not group.is_leader:
                self._follow_thread = threading.Thread(target=self._follow, name="follow-rank-0", daemon=True)
                self._follow_thread.start()
        except BaseException as e:  # noqa: BLE001 - any build failure is reported by /healthz, never raised away
            self._error = f"{type(e).__name__}: {e}"
            log.exception("engine build failed")
            if self.launch is not None and self.launch.rank > 0 and self._on_group_end is not None:
                # rank 0 reports it (the rank announced its failure); this rank leaves, to be started again
                self._on_group_end(f"the engine failed to start: {self._error}")
        else:
            self._ready_after = time.monotonic() - self._started
            self._ready.set()
            log.info(
                "engine ready",
                extra={"fields": {"seconds": round(self._ready_after, 3), "compiles": engine.status().compiles}},
            )
        finally:
            if self.engine is not None:  # where the time to ready (or to the failure) went
                log.info(
                    "engine build timeline",
                    extra={
                        "fields": {
                            "engine_created_after_seconds": round(created_after, 3),
                            "events": " ".join(
                                f"{label}@{t}"
                                for label, t in self.engine.build_timeline()
                                if not label.startswith("thread:")
                            ),
                        }
                    },
                )
            self._created.set()
            self._finished.set()

    def _follow(self) -> None:
        """Ranks other than 0: run rank 0's jobs until the group ends, then say why."""
        assert self.engine is not None
        try:
            reason = self.engine.follow(self._stop_following, self._follower_callbacks)
        except BaseException as e:  # noqa: BLE001 - whatever ends the loop ends this rank's part
            reason = f"{type(e).__name__}: {e}"
            log.exception("following rank 0 failed")
        self._group_end = reason
        log.warning("left the group", extra={"fields": {"reason": reason}})
        if self._on_group_end is not None and not self._stop_following.is_set():
            self._on_group_end(reason)

    def _follower_callbacks(self) -> JobCallbacks:
        """A job's callbacks on a rank other than 0: its steps go to this rank's metrics, and it
        asks the group to stop (a checkpoint on rank 0, then the job resumes with the group) once
        this daemon shuts down."""
        from dflash_core.engine import JobCallbacks

        stop, on_step = self._stop_following, self._on_follower_step

        class _Callbacks(JobCallbacks):
            def on_step(self, stats) -> None:
                if on_step is not None:
                    on_step(stats)

            def should_cancel(self) -> bool:
                return stop.is_set()

        return _Callbacks()

    def _on_phase(self, status) -> None:
        log.info(
            "engine progress",
            extra={
                "fields": {
                    "phase": status.phase,
                    "drafters_ready": status.drafters_ready,
                    "drafters_total": status.drafters_total,
                    "elapsed_seconds": round(status.elapsed_seconds, 3),
                }
            },
        )
        if WARMUP_PAUSE_SECONDS > 0 and status.phase != "ready":
            time.sleep(WARMUP_PAUSE_SECONDS)

    def wait_engine(self, timeout: float | None = None):
        """The engine object (maybe still warming), or None if it could not be created in time."""
        self._created.wait(timeout)
        return self.engine

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Block until the build ended (ready or failed)."""
        return self._finished.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop_following.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._follow_thread is not None:  # a job in progress stops at its next step (rank 0 checkpoints it)
            self._follow_thread.join(self.config.shutdown_timeout_seconds)
        group = self.engine.group if self.engine is not None else None
        if group is not None and group.is_leader and group.backend is not None and group.broken is None:
            with contextlib.suppress(Exception):  # the others may be gone already
                group.post({"kind": "shutdown"})
        if self.ready and self.engine is not None:
            self.engine.close()
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        """This process's engine is warm (in a group: see can_train for the whole group)."""
        return self._ready.is_set()

    @property
    def can_train(self) -> bool:
        """Jobs can start: the engine is warm and, in a group, every rank is warm, beating and in
        agreement (rank 0's view)."""
        if not self._ready.is_set():
            return False
        status = self.engine_status()
        return status is not None and status.group_problem is None and status.ranks_ready == status.ranks_total

    @property
    def group_problem(self) -> str | None:
        """Why the group cannot train (a lost or failed rank), or None."""
        status = self.engine_status()
        return status.group_problem if status is not None else None

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def build_thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def engine_status(self) -> EngineStatus | None:
        """The engine's status snapshot, or None before the engine object exists."""
        return self.engine.status() if self.engine is not None else None

    def phase(self) -> str:
        snapshot = self.engine_status()
        return snapshot.phase if snapshot is not None else "starting"

    def status(self, phase: str | None = None, snapshot: EngineStatus | None = None) -> str:
        """starting | warming | ready | failed; `phase` and `snapshot`: the engine's, when the caller
        has them. In a group: failed when the group cannot train, ready when every rank is."""
        if self._error is not None:
            return FAILED
        if snapshot is None:
            snapshot = self.engine_status()
        if snapshot is not None and (snapshot.group_problem is not None or self._group_end is not None):
            return FAILED
        if self._ready.is_set() and (
            snapshot is None or snapshot.rank != 0 or snapshot.ranks_ready >= snapshot.ranks_total
        ):
            return READY  # rank 0 speaks for the group; another rank for itself
        if self._ready.is_set():
            return WARMING  # this rank is warm; others are not yet
        return WARMING if (phase or self.phase()).startswith(("warming", "joining")) else STARTING

    def health(self) -> dict[str, Any]:
        snapshot = self.engine_status()  # one reading of the engine for the whole body
        phase = snapshot.phase if snapshot is not None else "starting"
        status = self.status(phase, snapshot)
        if snapshot is not None and snapshot.ranks_total > 1 and phase == "ready" and status != READY:
            group_failed = snapshot.group_problem is not None or self._group_end is not None
            phase = "group_failed" if group_failed else "waiting_for_ranks"
        body: dict[str, Any] = {
            "status": status,
            "phase": phase if status != FAILED or phase == "group_failed" else f"failed during {phase}",
            "drafters_ready": snapshot.drafters_ready if snapshot is not None else 0,
            "drafters_total": self.drafters_total,
            "elapsed_seconds": round(
                self._ready_after if self._ready_after is not None else time.monotonic() - self._started, 3
            ),
        }
        if self.launch is not None:
            body["rank"] = self.launch.rank
            body["ranks_ready"] = snapshot.ranks_ready if snapshot is not None else 0
            body["ranks_total"] = self.launch.world
        if status == FAILED:
            body["error"] = self._error or (snapshot.group_problem if snapshot else None) or self._group_end
        if status == READY and snapshot is not None:
            body["compiles"] = snapshot.compiles
            body["checkpoint_buffers"] = snapshot.checkpoint_buffers
            body["warmup_seconds"] = [
                {"component": w.component, "device": w.device, "seconds": round(w.seconds, 4)} for w in snapshot.warmup
            ]
        return body
