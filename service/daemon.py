"""What the app owns for its lifetime (`Daemon`): the data directory's lock, the job store, the
engine host, the job manager, the metrics and the event hub; started by the app's lifespan and
stopped by it."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from dflash_core.engine.launch import Launch

from .config import ServiceConfig
from .engine_host import EngineHost
from .event_feed import EventHub, StreamCollector
from .job_list import JobListCache
from .jobs.manager import JobManager
from .jobs.store import JobStore
from .metrics import ServiceMetrics
from .views import event_line

log = logging.getLogger("dflash.service")


class DataDirInUse(RuntimeError):
    pass


class DataDirLock:
    """One daemon per data directory: two would both run the queue's jobs."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # close-on-exec: a child process (inductor's compile workers, tokenizer workers) must not
        # inherit the lock and hold it after this daemon has exited
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DataDirInUse(
                f"another dflash-trainer daemon (pid {holder}) is using data dir {self.path.parent}"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Daemon:
    """Everything the app owns for its lifetime. In a multi-host group, ranks other than 0 own only
    their engine and its probes: no job store, no job API."""

    def __init__(self, config: ServiceConfig, launch: Launch | None = None):
        self.config = config
        self.launch = launch
        self.follower = launch is not None and launch.rank > 0
        self.exit_code = 0  # what `serve` exits with (a rank that lost its group: 1, so it is restarted)
        self.lock = DataDirLock(config.data_dir)
        self.store: JobStore | None = None
        self.host: EngineHost | None = None
        self.manager: JobManager | None = None
        self.job_list: JobListCache | None = None
        self.metrics: ServiceMetrics | None = None
        self.hub: EventHub | None = None
        self._shutting_down = threading.Event()

    def start(self) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        if self.follower:
            self._start_follower()
            return
        self.store = JobStore(self.config.database_path)
        self.job_list = JobListCache(self.store)
        self.host = EngineHost(self.config, self.launch)
        self.manager = JobManager(self.config, self.store, self.host)
        self.metrics = ServiceMetrics(self.host, self.store, draft_length=self.config.engine.draft_length)
        self.manager.metrics = self.metrics
        self.hub = EventHub(
            self.store, event_line, max_streams=self.config.max_event_streams, stopping=lambda: self.shutting_down
        )
        self.metrics.registry.register(StreamCollector(self.hub))
        self.manager.start()
        self.host.start()
        log.info(
            "daemon started",
            extra={"fields": {"data_dir": str(self.config.data_dir), "database": str(self.config.database_path)}},
        )

    def _start_follower(self) -> None:
        assert self.launch is not None
        self.host = EngineHost(
            self.config, self.launch, on_group_end=self._group_ended, on_follower_step=self._observe_step
        )
        self.metrics = ServiceMetrics(self.host, None, draft_length=self.config.engine.draft_length)
        self.host.start()
        log.info(
            "daemon started (rank %d of %d: probes and metrics only; jobs come from rank 0)",
            self.launch.rank,
            self.launch.world,
            extra={"fields": {"data_dir": str(self.config.data_dir)}},
        )

    def _observe_step(self, stats) -> None:
        if self.metrics is not None:
            self.metrics.observe_device_steps(stats)

    def _group_ended(self, reason: str) -> None:
        """A rank other than 0 stopped following rank 0: exit (like SIGTERM), so that the launcher
        or the orchestrator starts it, and with it the group, again. Exit 0 only when rank 0 ended
        the group on purpose."""
        self.exit_code = 0 if reason == "rank 0 shut the group down" else 1
        log.warning("leaving: %s", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def liveness(self) -> dict[str, Any]:
        """GET /livez's body: "dead", with the problems, when something died that only a restart
        brings back."""
        assert self.host is not None  # set by start(), which the lifespan runs before any request
        problems = []
        alive = not self.shutting_down  # while shutting down, threads end on purpose
        if self.manager is not None and not self.manager.worker_alive and alive:
            problems.append("the job worker thread died")
        status = self.host.engine_status()
        if self.host.ready and status is not None and not status.threads_alive and alive:
            problems.append("an engine drafter thread died")
        if self.host.failed:
            problems.append(f"the engine failed to start: {self.host.error}")
        if (group_problem := self.host.group_problem) is not None and alive:
            # a group that lost a rank cannot train again in this process: restarting it (and with it
            # the group) is the cure, which is what a liveness probe's failure makes an orchestrator do
            problems.append(f"the multi-host group cannot train: {group_problem}; restart the group")
        body: dict[str, Any] = {
            "status": "alive" if not problems else "dead",
            "engine": self.host.status(),
            "job_worker_alive": self.manager.worker_alive if self.manager is not None else False,
            "engine_build_running": self.host.build_thread_alive,
        }
        if problems:
            body["problems"] = problems
        return body

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down.is_set()

    def begin_shutdown(self) -> None:
        """Called on SIGTERM/SIGINT, before uvicorn drains connections: stops the running job at its
        next step (checkpointed, resumable) and ends event streams."""
        self._shutting_down.set()
        if self.manager is not None:
            self.manager.begin_shutdown()

    def stop(self) -> None:
        self._shutting_down.set()
        if self.manager is not None:
            self.manager.shutdown(self.config.shutdown_timeout_seconds)
            if self.manager.worker_alive:
                # the job is still inside a step: closing the engine or the database under it would
                # turn a clean resume into a crash; the process exit ends it, and the next start resumes
                log.error("job worker still busy at exit; leaving engine and database open")
                # and the data dir locked: a new daemon must not open the store while this process
                # still writes to it; the lock goes with the process
                return
        if self.host is not None:
            self.host.close()
        if self.store is not None:
            self.store.close()
        self.lock.release()
        log.info("daemon stopped")
