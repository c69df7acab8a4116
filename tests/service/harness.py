"""A real daemon for the service tests: `python -m service.cli serve --config FILE` as a subprocess
on a free 127.0.0.1 port, with a temporary data dir, the real engine on CPU and the embedded
default target. Nothing of ours is mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from service.demo import free_port
from service.jobs.store import TERMINAL

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_config(
    path: Path,
    data_dir: Path,
    *,
    auth_token: str | None = None,
    engine: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
) -> Path:
    lines = [f'data_dir = "{data_dir}"']
    if auth_token:
        lines.append(f'auth_token = "{auth_token}"')
    lines += [f"{key} = {json.dumps(value)}" for key, value in (settings or {}).items()]
    lines += ["", "[engine]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in (engine or {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """One daemon process; start() may be called again after stop()/kill() (same data dir and port)."""

    def __init__(self, config_path: Path, data_dir: Path, workdir: Path, warmup_pause: float = 0.0):
        """warmup_pause: seconds the daemon waits after each warm-up phase (its test hook,
        DFLASH_TEST_WARMUP_PAUSE_SECONDS), so that warming can be observed."""
        self.config_path = config_path
        self.warmup_pause = warmup_pause
        self.data_dir = data_dir
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir.parent / f"daemon-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self) -> Daemon:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        if self.warmup_pause:
            env["DFLASH_TEST_WARMUP_PAUSE_SECONDS"] = str(self.warmup_pause)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        with self.log_path.open("ab") as log:
            # cwd is an empty directory: the daemon must not write to the current directory
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "service.cli",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--port",
                    str(self.port),
                ],
                cwd=self.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:  # until uvicorn answers at all
            self._check_alive()
            try:
                self.http.get("/livez")
                return self
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon did not bind {self.url}; log:\n{self.log()}") from None
                time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}; log:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            r = self.http.get("/healthz")
            if r.status_code == 200:
                return r.json()
            assert r.json()["status"] != "failed", r.json()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready: {r.json()}\n{self.log()}")
            time.sleep(0.1)

    def submit(self, spec: dict[str, Any], expect: int = 202) -> dict[str, Any]:
        r = self.http.post("/jobs", json=spec)
        assert r.status_code == expect, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_job(self, job_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} never reached the condition: {job}")
            time.sleep(0.05)

    def wait_terminal(self, job_id: str, timeout: float = 120) -> dict[str, Any]:
        return self.wait_job(job_id, lambda j: j["state"] in TERMINAL, timeout)

    def events(self, job_id: str, **params: Any) -> list[dict[str, Any]]:
        r = self.http.get(f"/jobs/{job_id}/events", params=params)
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as a service manager would."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout} s; log:\n{self.log()}") from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
        finally:
            self.http.close()


def step_numbers(events: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in events if e["kind"] == "step"]
