"""Fixtures of the service tests: real daemons (see harness.py)."""

from __future__ import annotations

import pytest

from tests.service.harness import Daemon, write_config


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


@pytest.fixture(scope="module")
def daemon(make_daemon):
    """A ready daemon with the default configuration, shared by a module's tests (a module that
    needs another configuration defines its own `daemon`)."""
    d = make_daemon()
    d.wait_ready()
    return d
