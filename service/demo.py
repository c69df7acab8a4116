"""`make demo`: the whole system end to end on the embedded default.

Starts `dflash-trainer serve` as a subprocess on a free port, waits for /healthz 200, submits
examples/demo-job.json, follows it to the end, prints the checkpoint and the final tokens/s, and
stops the daemon with SIGTERM. The data directory is stable (`<data dir>/demo`), so the checkpoint
it prints is still there afterwards; the daemon's log goes to `<that dir>/daemon.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .cli_jobs import follow_job
from .client import DaemonClient, DaemonError
from .config import default_data_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JOB = REPO_ROOT / "examples" / "demo-job.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(data_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    log = log_path.open("ab")
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO_ROOT),
        )
    finally:
        log.close()


def stop_daemon(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_ready(client: DaemonClient, proc: subprocess.Popen, timeout: float, log_path: Path) -> dict:
    """The client's readiness wait, printing each new warmup phase and stopping if the daemon exits."""
    last_phase = None

    def progress(body: dict) -> None:
        nonlocal last_phase
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with code {proc.returncode}; see {log_path}")
        phase = body.get("phase", "starting the process")
        if phase != last_phase:
            print(
                f"  /healthz: {body.get('status')} ({phase}, "
                f"{body.get('drafters_ready', 0)}/{body.get('drafters_total', '?')} drafters)",
                flush=True,
            )
            last_phase = phase

    try:
        return client.wait_ready(timeout, on_progress=progress, interval=0.25)
    except TimeoutError:
        raise TimeoutError(f"daemon not ready after {timeout:.0f} s; see {log_path}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir() / "demo")
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    spec = json.loads(args.job.read_text())
    data_dir = args.data_dir.expanduser().absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "daemon.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting dflash-trainer serve on {url} (data dir {data_dir}, log {log_path})", flush=True)
    t0 = time.monotonic()
    proc = start_daemon(data_dir, port, log_path)
    client = DaemonClient(url)
    try:
        health = wait_ready(client, proc, args.ready_timeout, log_path)
        print(f"ready after {time.monotonic() - t0:.1f} s: compiles {health.get('compiles')}", flush=True)
        _status, job = client.submit(spec)
        print(f"submitted {args.job.name}: {job['id']} ({job['state']})", flush=True)
        job = follow_job(client, job["id"])
        p = job["progress"]
        print(f"\n{job['id']} {job['state']} after {p['step']}/{p['total_steps']} steps")
        if job["state"] != "SUCCEEDED":
            print(f"error: {job.get('error')}")
            return 1
        print(f"checkpoint:        {p['last_checkpoint']}")
        print(f"final tokens/s:    {p['tokens_per_second']:,.0f}")
        print(f"final loss:        {p['loss']:.4f}")
        if p.get("eval_acceptance_length") is not None:
            print(f"acceptance length: {p['eval_acceptance_length']:.3f} (held-out prompts)")
        print("checkpoints kept:  " + ", ".join(str(c["step"]) for c in job.get("checkpoints", [])))
        wanted = ("dflash_ready", "dflash_train_tokens_total", "dflash_compiles_total")
        lines = [ln for ln in client.metrics().splitlines() if ln.startswith(wanted)]
        print("metrics:\n  " + "\n  ".join(lines))
        return 0
    except (DaemonError, RuntimeError, TimeoutError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        client.close()
        code = stop_daemon(proc)
        # uvicorn re-raises the SIGTERM it handled once shut down, so -SIGTERM is a clean stop
        print("daemon stopped" if code in (0, -signal.SIGTERM) else f"daemon stopped (exit code {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
