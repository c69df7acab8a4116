"""The daemon as a two-host group: two torchrun launchers (one per "host", both on 127.0.0.1),
gloo on the CPU, the real `dflash-trainer serve` on each. Rank 0 serves the job API; rank 1 only
its probes and metrics. A killed rank fails the running job with a readable error while rank 0
keeps answering; starting the group again resumes the job from its last checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.demo import free_port
from service.jobs.store import TERMINAL
from tests.service.harness import REPO_ROOT, write_config

pytestmark = pytest.mark.slow


# the job of the rank-loss test: long enough that it is still training when rank 1 is killed (soon
# after the first checkpoint, at step 4), short enough that the resumed run is brief
STEPS = 32


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Node:
    """One host of the group: `torchrun --nnodes 2 --nproc-per-node 1 -m service.cli serve`."""

    def __init__(self, name: str, config: Path, port: int, log: Path):
        self.name, self.config, self.port, self.log_path = name, config, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.proc: subprocess.Popen | None = None

    def start(self, rdzv_port: int) -> Node:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        env["DFLASH_DISTRIBUTED_TIMEOUT_SECONDS"] = "60"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{rdzv_port}",
            "-m",
            "service.cli",
            "serve",
            "--config",
            str(self.config),
            "--port",
            str(self.port),
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def health(self) -> httpx.Response:
        return self.http.get("/healthz")

    def wait(self, until, what: str, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = until()
                if value:
                    return value
            except httpx.TransportError:
                pass
            if self.proc is not None and self.proc.poll() is not None and not _listening(self.port):
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) waiting for {what}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {what} did not happen:\n{self.log()}")
            time.sleep(0.2)

    def children(self) -> list[int]:
        """The processes torchrun started (in their own session: a signal to the launcher's
        process group does not reach them)."""
        assert self.proc is not None
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def worker_pid(self) -> int:
        """The daemon process torchrun started (the launcher's only child)."""
        children = self.children()
        assert children, f"{self.name}: no worker process"
        return children[0]

    def stop(self, timeout: float = 90) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.log()}") from None

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                for pid in self.children():
                    os.kill(pid, signal.SIGKILL)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        finally:
            self.http.close()


def start_group(nodes: list[Node]) -> None:
    rdzv = free_port()
    nodes[0].start(rdzv)  # hosts the rendezvous store: up before the other host joins
    nodes[0].wait(lambda: _listening(rdzv), "the rendezvous store")
    for node in nodes[1:]:
        node.start(rdzv)


def two_hosts(tmp_path: Path) -> list[Node]:
    """Two "hosts" on 127.0.0.1, each with its own data directory, config and port."""
    nodes = []
    for rank in range(2):
        data = tmp_path / f"host{rank}"
        data.mkdir()
        config = write_config(tmp_path / f"host{rank}.toml", data)
        nodes.append(Node(f"host{rank}", config, free_port(), tmp_path / f"host{rank}.log"))
    return nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """One two-host group for the module's tests (a start takes most of a test's time), in this
    order: the first loses a rank and starts the group again, the second drains a rank of the
    restarted group."""
    nodes = two_hosts(tmp_path_factory.mktemp("group"))
    try:
        start_group(nodes)
        yield nodes
    finally:
        for node in nodes:
            node.close()


def test_two_hosts_train_lose_a_rank_and_resume(nodes):
    lead, other = nodes
    body = lead.wait(lambda: (r := lead.health()).status_code == 200 and r.json(), "rank 0 ready", 240)
    assert (body["ranks_ready"], body["ranks_total"], body["rank"]) == (2, 2, 0)
    mine = other.wait(lambda: (r := other.health()).status_code == 200 and r.json(), "rank 1 ready")
    assert mine["rank"] == 1
    r = other.http.get("/jobs")
    assert r.status_code == 404 and "rank 0" in r.json()["detail"]
    assert "dflash_ready" in other.http.get("/metrics").text
    metrics = lead.http.get("/metrics").text
    assert "dflash_ranks_ready 2.0" in metrics and "dflash_ranks_expected 2.0" in metrics

    spec = {
        "datasets": ["builtin://train"],
        "output_dir": str(lead.config.parent / "host0" / "out"),
        "steps": STEPS,
        "checkpoint_interval": 4,
        "learning_rate": 3e-3,
    }
    r = lead.http.post("/jobs", json=spec)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    lead.wait(lambda: lead.http.get(f"/jobs/{job_id}").json()["checkpoints"], "a checkpoint", 240)
    # rank 1's metrics: its own device's step times (the job's series are rank 0's)
    page = other.http.get("/metrics").text
    count = re.search(r'^dflash_train_step_seconds_count\{device="cpu"\} (\S+)$', page, re.M)
    assert count and float(count.group(1)) > 0, page[-3000:]
    assert "dflash_train_loss{" not in page and "dflash_jobs{" not in page

    os.kill(other.worker_pid(), signal.SIGKILL)
    t = time.monotonic()
    job = lead.wait(
        lambda: (j := lead.http.get(f"/jobs/{job_id}").json())["state"] in TERMINAL and j, "the job's end", 120
    )
    assert time.monotonic() - t < 90
    assert job["state"] == "FAILED", job
    assert "rank" in job["error"] and "started again" in job["error"], job["error"]
    health = lead.health()  # rank 0 still answers, and says why the group cannot train
    assert health.status_code == 503 and health.json()["status"] == "failed", health.json()
    assert lead.http.get("/jobs").status_code == 200
    failed_at = max(c["step"] for c in job["checkpoints"])

    for node in nodes:  # the operator (or the orchestrator) starts the group again
        node.stop()
    start_group(nodes)
    job = lead.wait(
        lambda: (j := lead.http.get(f"/jobs/{job_id}").json())["state"] in TERMINAL and j, "the resumed job", 300
    )
    assert job["state"] == "SUCCEEDED", job
    events = [json.loads(line) for line in lead.http.get(f"/jobs/{job_id}/events").text.splitlines() if line]
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed and resumed[-1]["step"] == failed_at, resumed
    assert max(c["step"] for c in job["checkpoints"]) == STEPS


def test_a_rank_that_shuts_down_stops_the_job_at_a_checkpoint(nodes):
    """SIGTERM on another rank than 0 (a node drained): the group stops after the current step,
    rank 0 writes a checkpoint of that step, the job is FAILED to resume with the group, and that
    rank exits."""
    lead, other = nodes
    lead.wait(lambda: lead.health().status_code == 200, "rank 0 ready", 240)
    spec = {
        "datasets": ["builtin://train"],
        "output_dir": str(lead.config.parent / "host0" / "drained"),
        "steps": 500,
        "checkpoint_interval": 400,
    }
    r = lead.http.post("/jobs", json=spec)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    lead.wait(lambda: lead.http.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 3, "training", 240)
    other.stop()
    job = lead.wait(
        lambda: (j := lead.http.get(f"/jobs/{job_id}").json())["state"] in TERMINAL and j, "the job's end", 120
    )
    assert job["state"] == "FAILED" and "shutting down" in job["error"], job
    assert job["checkpoints"] and job["checkpoints"][-1]["step"] == job["progress"]["step"] < 400, job
    assert lead.health().json()["status"] == "failed"
