"""What clients following a job's events cost its training, on the CPU job of the embedded default.

    python -m bench.event_followers [--followers 200] [--rounds 24] [--window 10] [--idle]
    python -m bench.event_followers --merge RUN1.json RUN2.json ...   # several runs' windows together

Starts `dflash-trainer serve` on a temporary data directory with the embedded default (CPU, no
GPU needed), runs one job long enough for the whole run, and alternates windows of --window seconds:
no follower, then --followers clients following the job's events (`GET /jobs/{id}/events?follow=true`
from the newest step on, one HTTP connection each, so the steady stream is measured rather than the
catch-up). With --idle a third window per round: as many followers of a job queued behind the running
one, whose streams stay open and deliver nothing (the connections and the feed alone). The followers
live in a separate process (asyncio, no HTTP library), so that their own CPU use is counted apart from
the daemon's; on a machine of few cores it still competes with training.

Per window: the job's step rate (its step counter at both ends of the window) and its median time
between two steps (from its step events; a burst of other work on the machine stalls a few steps,
which moves the rate more than the median), the CPU time of the daemon's event loop (its main thread,
which serves HTTP; system time apart: the kernel's work for its socket writes), of the whole daemon,
of the follower process, and of everything else on the machine. Each window's cost is taken against
the no-follower windows on either side of it, since the step rate drifts, and only windows in which
the rest of the machine stayed quiet count (--quiet-below). On a CPU job the step rate moves by
several % from one window to the next by itself, so the costs come with a 95 % interval of their
median and need many rounds; the followers of a queued job are the control: they cost the event
loop next to nothing, so what their windows show is that noise. Prints the medians per phase and
writes $OUT/event_followers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LONG_JOB = {"datasets": ["builtin://train"], "steps": 10**7, "checkpoint_interval": 10**7}


# --------------------------------------------------------------------------- the followers' process
class _Follower(asyncio.Protocol):
    """One connection following one stream; counts what arrives, parses nothing."""

    def __init__(self, request: bytes, stats: dict[str, int], started: asyncio.Event, wanted: int):
        self.request, self.stats, self.started, self.wanted = request, stats, started, wanted
        self.head = True

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.head:
            self.head = False
            if not data.startswith(b"HTTP/1.1 200"):
                self.stats["refused"] += 1
            self.stats["answered"] += 1
            if self.stats["answered"] >= self.wanted:
                self.started.set()
        self.stats["bytes"] += len(data)
        self.stats["reads"] += 1
        self.stats["steps"] += data.count(b'"kind": "step"')

    def connection_lost(self, exc) -> None:
        self.stats["closed"] += 1


async def _follow(port: int, target: str, count: int) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    stats = {"answered": 0, "refused": 0, "closed": 0, "bytes": 0, "reads": 0, "steps": 0}
    started, stop = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    request = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    transports = []
    for _ in range(count):
        transport, _ = await loop.create_connection(
            lambda: _Follower(request, stats, started, count), "127.0.0.1", port
        )
        transports.append(transport)
    await started.wait()
    print("streaming", flush=True)
    await stop.wait()
    stats["closed_early"] = stats["closed"]  # by the daemon, while they followed
    for transport in transports:
        transport.close()
    return stats


class Followers:
    """`count` followers of `target` in a child process (this module with --client)."""

    def __init__(self, port: int, target: str, count: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.event_followers", "--client", str(port), target, str(count)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "streaming":
            self.proc.kill()
            raise RuntimeError(f"the followers did not start: {line!r}")

    def cpu_seconds(self) -> float:
        return process_cpu(self.proc.pid)

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- measuring
def _ticks(stat_path: Path) -> tuple[int, int]:
    """(user, system) clock ticks of a process or thread."""
    # fields after the command name (which may hold spaces): utime and stime are the 12th and 13th
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def process_cpu(pid: int) -> float:
    """CPU seconds of a process, all its threads."""
    return sum(_ticks(Path(f"/proc/{pid}/stat"))) / CLOCK_TICKS


def thread_cpu(pid: int, tid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one thread: system time is the kernel's work for it, which for
    a thread that writes to sockets is mostly the network's (on loopback, the receiving side's too)."""
    user, system = _ticks(Path(f"/proc/{pid}/task/{tid}/stat"))
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def machine_cpu() -> float:
    """CPU seconds the whole machine spent busy (every process, the kernel's interrupt work too);
    counted by the tick, so it agrees with the per-process times to a few % only."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def metric(client: httpx.Client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


class Bench:
    """One daemon on a temporary data directory, and the windows measured against it."""

    def __init__(self, args: argparse.Namespace, work: Path):
        from service.demo import free_port

        self.args = args
        self.port = free_port()
        config = work / "dflash.toml"
        config.write_text(
            f'data_dir = "{work / "data"}"\nmax_event_streams = {args.followers + 16}\nlog_level = "warning"\n'
        )
        self.log = work / "daemon.log"
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve", "--config", str(config), "--port", str(self.port)],
                cwd=work,
                env=dict(os.environ, PYTHONPATH=path),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.cursor = 0  # the newest step event read

    def ready(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited; see {self.log}")
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 300, "the daemon was not ready in time")

    def submit(self, spec: dict) -> str:
        r = self.http.post("/jobs", json=spec)
        r.raise_for_status()
        return r.json()["id"]

    def step(self, job_id: str) -> int:
        return self.http.get(f"/jobs/{job_id}").json()["progress"]["step"]

    def step_events(self, job_id: str) -> list[dict]:
        """The job's step events since the last call."""
        r = self.http.get(f"/jobs/{job_id}/events", params={"after": self.cursor, "kind": "step"})
        events = [json.loads(line) for line in r.text.splitlines()]
        self.cursor = max([self.cursor, *(e["event_id"] for e in events)])
        return events

    def newest_event(self, job_id: str) -> int:
        lines = self.http.get(f"/jobs/{job_id}/events").text.splitlines()
        return json.loads(lines[-1])["event_id"] if lines else 0

    def window(self, job_id: str, followers: Followers | None) -> dict:
        pid = self.proc.pid
        self.step_events(job_id)
        wall0, t0, s0 = time.time(), time.monotonic(), self.step(job_id)
        loop0, all0, machine0 = thread_cpu(pid, pid), process_cpu(pid), machine_cpu()
        client0 = followers.cpu_seconds() if followers else 0.0
        time.sleep(self.args.window)
        s1, t1 = self.step(job_id), time.monotonic()
        loop1, all1, machine1 = thread_cpu(pid, pid), process_cpu(pid), machine_cpu()
        client1 = followers.cpu_seconds() if followers else 0.0
        wall1, seconds = time.time(), t1 - t0
        daemon, client = all1 - all0, client1 - client0
        times = sorted(e["time"] for e in self.step_events(job_id) if wall0 <= e["time"] <= wall1)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return {
            "steps_per_s": (s1 - s0) / seconds,
            "median_steps_per_s": 1 / statistics.median(gaps) if gaps else float("nan"),
            "loop_cpu_pct": 100 * (sum(loop1) - sum(loop0)) / seconds,
            "loop_system_cpu_pct": 100 * (loop1[1] - loop0[1]) / seconds,
            "daemon_cpu_pct": 100 * daemon / seconds,
            "client_cpu_pct": 100 * client / seconds,
            # everything else the machine ran meanwhile (this script, other programs, the kernel's
            # work not charged to a process): a window with much of it is noise
            "other_cpu_pct": 100 * (machine1 - machine0 - daemon - client) / seconds,
        }

    def followed_window(self, job_id: str, streamed_job: str) -> dict:
        after = self.cursor if streamed_job == job_id else self.newest_event(streamed_job)
        followers = Followers(self.port, f"/jobs/{streamed_job}/events?follow=true&after={after}", self.args.followers)
        try:
            wait_for(
                lambda: metric(self.http, "dflash_event_streams") >= self.args.followers, 60, "followers not served"
            )
            time.sleep(self.args.settle)
            row = self.window(job_id, followers)
        finally:
            stats = followers.stop()
        wait_for(lambda: metric(self.http, "dflash_event_streams") == 0, 60, "streams not closed")
        if stats["refused"] or stats["closed_early"]:
            raise RuntimeError(f"followers refused or cut off: {stats}")
        row["step_lines_received"] = stats["steps"]
        row["reads_per_follower"] = stats["reads"] / self.args.followers
        return row

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()


# --------------------------------------------------------------------------- report
def paired_costs(ws: list[dict], alone: list[dict], key: str, quiet) -> list[float]:
    """The cost in % of the rate `key` of each quiet window, against the quiet no-follower windows
    on either side of it (the step rate drifts; the last window has none after it)."""
    costs = []
    for i, w in enumerate(ws):
        around = [a[key] for a in alone[i : i + 2] if quiet(a)]
        if quiet(w) and around:
            costs.append(100 * (1 - w[key] / statistics.mean(around)))
    return costs


def summary(runs: list[dict[str, list[dict]]], followers: int, quiet_below: float) -> list[dict]:
    """One row per phase over the windows of one or more runs (each phase's windows, in order),
    from the windows in which the rest of the machine stayed quiet (other programs take the CPU in
    bursts, and the step rate falls with them)."""

    def quiet(w: dict) -> bool:
        return w["other_cpu_pct"] <= quiet_below

    def spread(costs: list[float]) -> str:
        """The median cost and its 95 % interval (bootstrap: the windows resampled)."""
        if not costs:
            return "-"
        draw = random.Random(0)
        medians = sorted(statistics.median(draw.choices(costs, k=len(costs))) for _ in range(2000))
        return f"{statistics.median(costs):.1f} % [{medians[50]:.1f}, {medians[1949]:.1f}]"

    def costs(phase: str, key: str) -> list[float]:  # paired within each run
        return [c for run in runs for c in paired_costs(run[phase], run["alone"], key, quiet)]

    rows = []
    for phase in runs[0]:
        all_ws = [w for run in runs for w in run[phase]]
        ws = [w for w in all_ws if quiet(w)] or all_ws

        def median(key: str, ws: list[dict] = ws) -> float:
            return statistics.median(w[key] for w in ws)

        rates = [w["steps_per_s"] for w in ws]
        alone = phase == "alone"
        rows.append(
            {
                "phase": phase if alone else f"{followers} {phase}",
                "quiet windows": f"{sum(map(quiet, all_ws))}/{len(all_ws)}",
                "steps/s (range)": f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})",
                "median step": f"{1000 / median('median_steps_per_s'):.1f} ms",
                "cost: steps/s [95 % CI]": "" if alone else spread(costs(phase, "steps_per_s")),
                "cost: median step [95 % CI]": "" if alone else spread(costs(phase, "median_steps_per_s")),
                "loop CPU (system)": f"{median('loop_cpu_pct'):.1f} % ({median('loop_system_cpu_pct'):.1f} %)",
                "daemon CPU": f"{median('daemon_cpu_pct'):.0f} %",
                "client CPU": f"{median('client_cpu_pct'):.1f} %",
                "other CPU": f"{median('other_cpu_pct'):.0f} %",
            }
        )
    return rows


def report(runs: list[dict[str, list[dict]]], args: argparse.Namespace) -> None:
    from bench.common import print_table

    rows = summary(runs, args.followers, args.quiet_below)
    print(
        f"\n{len(runs)} run(s) of {args.rounds} rounds of {args.window:.0f} s windows, {os.cpu_count()} CPUs; "
        f"CPU in % of one core; quiet: other programs below {args.quiet_below:.0f} %"
    )
    print_table(rows, list(rows[0]))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        print(json.dumps(asyncio.run(_follow(int(argv[1]), argv[2], int(argv[3])))), flush=True)
        return
    p = argparse.ArgumentParser()
    p.add_argument("--followers", type=int, default=200)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--window", type=float, default=10.0, help="seconds each window lasts")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the followers' start and a window")
    p.add_argument("--warm-steps", type=int, default=30, help="steps the job runs before the first window")
    p.add_argument("--idle", action="store_true", help="also windows with followers of a queued job")
    p.add_argument(
        "--quiet-below",
        type=float,
        default=15.0,
        help="the costs count windows in which the rest of the machine used less CPU than this (% of a core)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: report the windows of earlier runs (their event_followers.json) together",
    )
    args = p.parse_args(argv)
    from bench.common import out_dir

    if args.merge:
        records = [json.loads(Path(path).read_text()) for path in args.merge]
        args.rounds = "/".join(str(r["args"]["rounds"]) for r in records)
        report([r["windows"] for r in records], args)
        return

    phases = ["alone", "followers"] + (["idle followers"] if args.idle else [])
    windows: dict[str, list[dict]] = {phase: [] for phase in phases}
    with tempfile.TemporaryDirectory(prefix="dflash-followers-") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            bench.ready()
            job = bench.submit(LONG_JOB)
            queued = bench.submit(LONG_JOB) if args.idle else None
            wait_for(lambda: bench.step(job) >= args.warm_steps, 300, "the job did not start training")
            for round_ in range(args.rounds):
                for phase in phases:
                    if phase == "alone":
                        row = bench.window(job, None)
                    else:
                        row = bench.followed_window(job, job if phase == "followers" else str(queued))
                    windows[phase].append(row)
                    print(f"round {round_ + 1} {phase}: " + json.dumps({k: round(v, 2) for k, v in row.items()}))
            bench.http.post(f"/jobs/{job}/cancel")
            if queued:
                bench.http.post(f"/jobs/{queued}/cancel")
        finally:
            bench.close()
    record = {"args": vars(args), "cpus": os.cpu_count(), "windows": windows}
    (out_dir() / "event_followers.json").write_text(json.dumps(record, indent=1))
    report([windows], args)


if __name__ == "__main__":
    main()
