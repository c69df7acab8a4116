"""Where a daemon start's seconds go, sampled: `dflash-trainer serve` under `py-spy record` until
/healthz says ready.

    python -m bench.startup_profile --config FILE [--seconds 120] [--rate 100]

Samples every thread of the daemon (GIL holders or not, idle excluded) at `--rate` Hz (the
sampler slows Python down: a lower rate stretches the start less) from the start
of the process to ready. Prints, for the engine's build thread and for all threads together, the
seconds spent under each of our functions and each module import (inclusive), so that a warm
start's time can be split into imports, loading, warm-up and what else runs. Needs py-spy (the
`bench` extra). Writes $OUT/startup_profile.txt (py-spy's raw stacks).
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import time

import httpx

from bench.common import out_dir, print_table

RATE = 100
OURS = re.compile(r"^(\S+) \(((?:dflash_core|service)/[^:]+):\d+\)$")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--seconds", type=float, default=120, help="give up waiting for ready after this long")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--rate", type=int, default=RATE, help="samples per second")
    args = p.parse_args(argv)
    if args.rate <= 0:
        p.error("--rate must be positive")
    import tomllib

    with open(args.config, "rb") as f:
        port = tomllib.load(f).get("port", 8000)
    raw = out_dir() / "startup_profile.txt"
    started = time.monotonic()
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--rate",
            str(args.rate),
            "--format",
            "raw",
            "--threads",
            "--output",
            str(raw),
            "--",
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--config",
            args.config,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ready_s = None
    while time.monotonic() - started < args.seconds and spy.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                ready_s = time.monotonic() - started
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    child = subprocess.run(["pgrep", "-P", str(spy.pid)], capture_output=True, text=True).stdout.split()
    for pid in child:
        subprocess.run(["kill", "-TERM", pid])
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: collections.Counter = collections.Counter()  # build thread: deepest of ours -> what it called
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0]
        seen = set()
        for frame in frames[1:]:
            m = OURS.match(frame)
            key = f"{m.group(2)}::{m.group(1)}" if m else None
            if key is None and frame.startswith("<module> ("):
                key = "import " + frame[len("<module> (") :].split(":")[0]
            if key and key not in seen:
                seen.add(key)
                per_thread[thread][key] += int(count)
                per_thread["all threads"][key] += int(count)
        if "engine-build" in thread:
            ours = [i for i, f in enumerate(frames) if OURS.match(f)]
            if ours:
                i = ours[-1]
                below = (
                    frames[i + 1].split(" (")[0] + " (" + frames[i + 1].split(" (")[-1] if i + 1 < len(frames) else "-"
                )
                leaves[f"{frames[i]} -> {below}"] += int(count)
    rows = []
    for thread, counter in per_thread.items():
        if thread != "all threads" and "engine-build" not in thread:
            continue
        for key, n in counter.most_common(args.top):
            rows.append({"thread": thread[:40], "seconds": round(n / args.rate, 2), "where": key[:110]})
    print_table(
        [
            {"seconds": round(n / args.rate, 2), "build thread: ours -> callee": k[:150]}
            for k, n in leaves.most_common(args.top)
        ],
        ["seconds", "build thread: ours -> callee"],
    )
    print(f"\nready after {ready_s and round(ready_s, 1)} s (process start -> /healthz 200), sampled at {args.rate} Hz")
    print_table(rows, ["thread", "seconds", "where"])


if __name__ == "__main__":
    main()
