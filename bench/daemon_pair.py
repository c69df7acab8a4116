"""The guarded figures of a change: two trees' daemons on one host, each precision in both orders.

    python -m bench.daemon_pair --tree before=<dir> --tree after=. [--precisions bf16,fp8]
        [--deadline 560] [-- <bench.daemon_gpu arguments>]

Each tree is a checkout of the code (`git archive REV | tar x -C DIR` makes one without a
clone); each runs its own `python -m bench.daemon_gpu` from its own directory, so a tree measures
its bench as well as its daemon. The arguments after `--` replace the default ones, the guarded
figures' command: `--colocated --anchors 512 --steps 20 --timeout 120 --warm-starts 1
--bytecode-kept`; an fp8 run adds `--engine-extra` with the drafter's and the target's precision.

Order: the first precision runs the trees in the order given, the next in reverse, and so on
(after, before, before, after with two precisions), since a host's first daemon start runs
slower in phases no change touches (imports, the compile child's dynamo); the table says each
run's place. `--deadline` (seconds from the start) skips a run that could not finish inside it,
for runners that bound a call; a skipped run is a row that says so.

Output: $OUT/<tree>_<precision>/ (daemon_gpu's own files) and <tree>_<precision>.log,
$OUT/daemon_pair.json and the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import out_dir, print_table

DEFAULT_DAEMON_ARGS = ["--colocated", "--anchors", "512", "--steps", "20", "--timeout", "120"]
DEFAULT_DAEMON_ARGS += ["--warm-starts", "1", "--bytecode-kept"]
FP8_ENGINE = 'precision = "fp8"\ntarget_precision = "fp8"'
# the least a run takes on a fast host (a cold and a warm start, a 20-step job): a run that could
# not end before the deadline is skipped rather than cut off
RUN_FLOOR_S = 100

COLUMNS = [
    "daemon",
    "tree (order)",
    "cold ready",
    "warm ready",
    "compile child (kernels)",
    "target's warm-up",
    "job start to first step (first step)",
    "step",
    "steps/s",
    "anchor updates/s",
    "runtime compiles",
    "reserved swing",
]


def parse_trees(specs: list[str]) -> dict[str, Path]:
    """NAME=DIR pairs, in the order given; each DIR a tree with bench/daemon_gpu.py in it."""
    trees: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--tree takes NAME=DIR, not {spec!r}")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--tree {spec!r}: a name of letters, digits, '-' and '_' (it names the output folders)")
        if name in trees:
            raise ValueError(f"--tree {name!r} is given twice")
        tree = Path(path).resolve()
        if not (tree / "bench" / "daemon_gpu.py").is_file():
            raise ValueError(f"--tree {spec!r}: {tree} has no bench/daemon_gpu.py")
        trees[name] = tree
    if len(trees) < 2:
        raise ValueError("--tree: give two trees (NAME=DIR each), the change's before and after")
    return trees


def run_order(trees: list[str], precisions: list[str]) -> list[tuple[str, str]]:
    """(tree, precision) runs: each precision's trees in turn, the order reversed at each precision."""
    runs = []
    for i, precision in enumerate(precisions):
        names = trees if i % 2 == 0 else list(reversed(trees))
        runs += [(name, precision) for name in names]
    return runs


def daemon_args(extra: list[str], precision: str) -> list[str]:
    args = list(extra or DEFAULT_DAEMON_ARGS)
    if precision == "fp8":
        args += ["--engine-extra", FP8_ENGINE]
    return args


def _swing(row: dict) -> float | None:
    swings = [v for k, v in row.items() if k.startswith("job_reserved_swing_pct")]
    return max(swings) if swings else None


def pair_row(record: dict, tree: str, precision: str, place: int) -> dict:
    """A table row from one run's daemon_gpu.json: its first cold start (which ran the job) and the
    median of its warm starts (the only warm start where there is one)."""
    rows = record["rows"]
    cold = next(r for r in rows if r["cache"].startswith("cold"))
    warm_rows = [r for r in rows if r["cache"].startswith("warm median")] or [
        r for r in rows if r["cache"].startswith("warm")
    ]
    warm = warm_rows[0] if warm_rows else {}
    anchors = int(record["args"]["anchors"])
    ran = cold.get("state") == "SUCCEEDED"
    step_ms = cold.get("step_ms") if ran else None  # a failed job's steps are not its rate
    runtime = max(float(r.get('compiles_total{phase="runtime"}', 0.0)) for r in rows)
    swing = _swing(cold)
    row = {
        "daemon": precision,
        "tree (order)": f"{tree} ({place})",
        "cold ready": f"{cold['ready_s']} s",
        "warm ready": f"{warm['ready_s']} s" if "ready_s" in warm else "-",
        "compile child (kernels)": f"{cold['side_s']} s ({cold.get('side_kernels', '-')})" if "side_s" in cold else "-",
        "target's warm-up": f"{cold['target_s']} s" if "target_s" in cold else "-",
        "job start to first step (first step)": (
            f"{cold['to_first_step_s']} s ({cold['first_step_s']} s)" if "to_first_step_s" in cold else "-"
        ),
        "step": f"{step_ms} ms" if step_ms else f"job {cold.get('state', 'not run')}",
        "steps/s": f"{1000 / step_ms:.2f}" if step_ms else "-",
        "anchor updates/s": f"{anchors * 1000 / step_ms:,.0f}" if step_ms else "-",
        "runtime compiles": f"{runtime:g}",
        "reserved swing": f"{swing:g} %" if swing is not None else "-",
    }
    return row


def skipped_row(tree: str, precision: str, place: int, why: str) -> dict:
    return {"daemon": precision, "tree (order)": f"{tree} ({place})", "cold ready": why}


def run_one(tree: Path, name: str, precision: str, args: list[str], out: Path, timeout: float) -> dict | None:
    """One tree's bench.daemon_gpu in its own directory, its output under out/<name>_<precision>;
    its record, or None where it wrote none (the log says why)."""
    label = f"{name}_{precision}"
    record = out / label / "daemon_gpu.json"
    record.unlink(missing_ok=True)  # an earlier run's record in the same $OUT is not this run's
    env = dict(os.environ, OUT=str(out / label), DAEMON_WORK=f"/tmp/dflash-daemon-pair-{label}")
    with open(out / f"{label}.log", "w") as log:
        # a session of its own: cut off, the bench goes with the daemon it started, which would
        # otherwise hold the GPU through the next run
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.daemon_gpu", *args],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it ended between the timeout and the kill
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"{label}: cut off at {timeout:.0f} s", file=log)
    return json.loads(record.read_text()) if record.is_file() else None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR, twice: the trees in their first order")
    p.add_argument("--precisions", default="bf16,fp8", help="comma-separated: bf16, fp8")
    p.add_argument("--deadline", type=float, default=0, help="seconds from the start a run must end by (0: none)")
    args = p.parse_args(argv)
    try:
        trees = parse_trees(args.tree)
    except ValueError as e:
        p.error(str(e))
    precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if not precisions or not set(precisions) <= {"bf16", "fp8"} or len(set(precisions)) < len(precisions):
        p.error("--precisions takes bf16 and fp8, each once")
    out = out_dir()
    t0 = time.monotonic()
    rows, records = [], {}
    for place, (name, precision) in enumerate(run_order(list(trees), precisions), start=1):
        left = args.deadline - (time.monotonic() - t0) if args.deadline else None
        if left is not None and left < RUN_FLOOR_S:
            rows.append(skipped_row(name, precision, place, f"skipped: {left:.0f} s left"))
            continue
        print(f"=== {name} {precision} ({place})", flush=True)
        record = run_one(trees[name], name, precision, daemon_args(passthrough, precision), out, left if left else 3600)
        if record is None:
            rows.append(skipped_row(name, precision, place, f"no result: see {name}_{precision}.log"))
            continue
        records[f"{name}_{precision}"] = record
        rows.append(pair_row(record, name, precision, place))
        print(rows[-1], flush=True)
    (out / "daemon_pair.json").write_text(
        json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": records, "rows": rows}, indent=1)
    )
    print(f"\nthe guarded figures, {' and '.join(trees)} on one host ({time.monotonic() - t0:.0f} s)")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
