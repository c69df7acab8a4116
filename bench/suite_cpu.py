"""Where the test suite's CPU time goes: pytest under a /proc poller, CPU seconds by kind of process.

    python -m bench.suite_cpu [--interval 0.3] [--top 15] [-- <pytest arguments>]

The suite is CPU bound on the CI machine's two cores, and most of its CPU time is spent outside
the pytest workers: in the daemons, ranks, probes and compilers the tests start, which pytest's
--durations does not see. This runs `python -m pytest` (default arguments: `make test`'s) and reads
every descendant process's CPU time from /proc every --interval seconds, with the test that
started it (PYTEST_CURRENT_TEST in its environment, inherited from the worker that spawned it).
A process shorter than the interval may be missed, so the C++ compilers' figure is a floor.
Linux only. Prints the suite's wall time and two tables: CPU seconds by kind of process, and the
test modules whose processes took the most; writes $OUT/suite_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.tables import out_dir, print_table

DEFAULT_PYTEST = ["-q", "-p", "no:cacheprovider", "-n", "2", "tests"]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TEST_VAR = b"PYTEST_CURRENT_TEST="

# (kind, a substring of the command line that marks it), first match wins
KINDS = [
    ("pytest workers (the tests' own code)", "exec(eval(sys.stdin.readline()))"),
    ("daemons (service.cli serve)", "service.cli serve"),
    ("CLI calls (service.cli)", "service.cli"),
    ("interpreted Triton checks", "tests.decode_attention_check"),
    ("interpreted Triton checks", "tests.interpreted_checks"),
    ("ranks (torchrun, engine_rank)", "torch.distributed.run"),
    ("ranks (torchrun, engine_rank)", "engine_rank"),
    ("C++ compiles (inductor)", "cc1plus"),
    ("C++ compiles (inductor)", "gcc"),
    ("other Python processes (probes, compile children, tools)", "python"),
]


def kind_of(cmd: str) -> str:
    return next((kind for kind, mark in KINDS if mark in cmd), "other")


def _stat(pid: str) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds, start tick) of a process, or None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, int(fields[19])


def _describe(pid: str) -> tuple[str, str]:
    """A process's command line and the test that started it ('' where none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return "", ""
    test = next((e[len(_TEST_VAR) :].decode(errors="replace") for e in env if e.startswith(_TEST_VAR)), "")
    return cmd, test


def poll(root: int, seen: dict[tuple[int, int], dict]) -> None:
    """One pass over /proc: the descendants of `root` (and it), their CPU seconds so far."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
    parents = {pid: s[0] for pid, s in stats.items()}
    for pid, (_, cpu, start) in stats.items():
        up, hops = pid, 0
        while up != root and up in parents and hops < 64:
            up, hops = parents[up], hops + 1
        if up != root:
            continue
        key = (pid, start)
        if key not in seen:
            cmd, test = _describe(str(pid))
            seen[key] = {"pid": pid, "cmd": cmd[:300], "test": test, "cpu": cpu}
        else:
            seen[key]["cpu"] = cpu


def module_of(test: str) -> str:
    return test.split("::", 1)[0] if test else "(no test: the session, collection)"


def summarize(procs: list[dict], top: int) -> tuple[list[dict], list[dict]]:
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    by_module: dict[str, list[float]] = collections.defaultdict(list)
    for p in procs:
        by_kind[kind_of(p["cmd"])].append(p["cpu"])
        if kind_of(p["cmd"]) != KINDS[0][0]:  # a worker runs many modules' tests
            by_module[module_of(p["test"])].append(p["cpu"])
    total = sum(p["cpu"] for p in procs) or 1.0
    kinds = [
        {"kind": k, "processes": len(v), "CPU s": f"{sum(v):.0f}", "share": f"{100 * sum(v) / total:.0f} %"}
        for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))
    ]
    modules = [
        {"test module": k, "processes": len(v), "CPU s": f"{sum(v):.1f}"}
        for k, v in sorted(by_module.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    return kinds, modules


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interval", type=float, default=0.3, help="seconds between two reads of /proc")
    p.add_argument("--top", type=int, default=15, help="test modules listed")
    # after `--`, argparse takes every argument as one of these, options included
    p.add_argument("pytest_args", nargs="*", help="pytest's arguments, after -- (default: make test's)")
    args = p.parse_args(argv)
    pytest_args = args.pytest_args
    if args.interval <= 0 or args.top < 1:
        p.error("--interval takes a positive number of seconds and --top a positive count")
    if not Path("/proc/self/stat").exists():
        p.error("reads /proc: Linux only")
    seen: dict[tuple[int, int], dict] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *(pytest_args or DEFAULT_PYTEST)])
    while proc.poll() is None:
        poll(proc.pid, seen)
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    procs = list(seen.values())
    kinds, modules = summarize(procs, args.top)
    cpu = sum(q["cpu"] for q in procs)
    record = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "pytest_rc": proc.returncode, "processes": procs}
    (out_dir() / "suite_cpu.json").write_text(json.dumps(record, indent=1))
    print(f"\nsuite: {wall:.0f} s wall, {cpu:.0f} CPU s in {len(procs)} processes (pytest exit {proc.returncode})")
    print_table(kinds, ["kind", "processes", "CPU s", "share"])
    print()
    print_table(modules, ["test module", "processes", "CPU s"])
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
