"""Fixtures of the service tests: real daemons (see harness.py)."""

from __future__ import annotations

import time

import pytest

from tests.service.harness import Daemon, write_config

# the states of a job that still holds the daemon's job worker or waits for it
UNFINISHED = ("PENDING", "RUNNING")


@pytest.fixture(scope="module")
def make_daemon(tmp_path_factory):
    """Factory: make_daemon(auth_token=, warmup_pause=, engine={...}, settings={top-level field: value})
    -> a started Daemon (not yet ready)."""
    started: list[Daemon] = []

    def make(
        *,
        auth_token: str | None = None,
        warmup_pause: float = 0.0,
        engine: dict | None = None,
        settings: dict | None = None,
        start: bool = True,
    ) -> Daemon:
        root = tmp_path_factory.mktemp("daemon")
        data_dir = root / "data"
        workdir = root / "cwd"
        workdir.mkdir()
        config = write_config(root / "dflash.toml", data_dir, auth_token=auth_token, engine=engine, settings=settings)
        daemon = Daemon(config, data_dir, workdir, warmup_pause=warmup_pause)
        started.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in started:
        daemon.close()


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    """One daemon with the default configuration per test process (each xdist worker), lent to
    the modules that take `daemon`: a start is mostly the imports of a fresh interpreter, several
    seconds on 2 cores, and these modules need nothing of a daemon of their own."""
    root = tmp_path_factory.mktemp("shared-daemon")
    workdir = root / "cwd"
    workdir.mkdir()
    d = Daemon(write_config(root / "dflash.toml", root / "data"), root / "data", workdir)
    yield d
    d.close()


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    """A ready daemon with the default configuration, shared by a module's tests: the process's
    shared one, started again if a module before stopped it, and idle (a job another module left
    unfinished is cancelled first). A module that needs another configuration, or asserts on
    every job a daemon holds, defines its own `daemon`."""
    d = shared_daemon
    if d.proc is None or d.proc.poll() is not None:
        d.start()
    d.wait_ready()
    _settle(d)
    return d


def _settle(d: Daemon, timeout: float = 120) -> None:
    """Cancel the daemon's unfinished jobs and wait until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = [j for state in UNFINISHED for j in d.http.get("/jobs", params={"state": state}).json()["jobs"]]
        if not left:
            return
        for job in left:
            if not job.get("cancel_requested"):
                d.http.post(f"/jobs/{job['id']}/cancel")
        assert time.monotonic() < deadline, f"jobs left unfinished: {left}"
        time.sleep(0.1)
