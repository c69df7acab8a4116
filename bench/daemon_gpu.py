"""The daemon on the GPU machine with a Qwen3-8B-shaped random-weight target.

    python -m bench.daemon_gpu [--anchors 256] [--steps 100] [--prometheus BIN]

Starts `dflash-trainer serve` (target on cuda:0, drafter on cuda:1; colocated on cuda:0 with one
GPU) with a cold inductor cache and measures time to /healthz 200; runs one job; keeps /metrics;
stops it (SIGTERM) and starts it again on the warm cache to measure time to ready once more
(--warm-starts N: N times, and their median; --precompile: `dflash-trainer precompile` on the empty
caches before each cold start, which is then the start after it; --bytecode-kept: the cold start
finds the libraries' bytecode compiled, as the image the Dockerfile builds has it, and only the
compile caches empty; --cold-starts N: N cold starts, each on emptied caches, and their median
(a cold start's time varies from one start to the next; the job runs after the first);
--warm-env "A;B": the warm starts take turns with
these environments, e.g. "TORCHINDUCTOR_COMPILE_THREADS=1", and a median is reported per
environment; "" is the unchanged one).
The job is submitted once the checkpoint snapshot's host buffers, which the daemon pins in the
background from ready on, are pinned (`checkpoint_buffers` in /healthz; the row's `pinned_s`, the
seconds after ready), so that its steps are the steady ones; --job-at-ready submits it at ready,
beside the pinning (what a job arriving at once sees). Context tokens/s of the job = the full
pipeline (target forward + drafter step + grad sync + optimizer). Writes $OUT/daemon_gpu.json and the /metrics pages; prints a table last.
A start's row also says where a cold start's time went, from the daemon's log: `side_s` and
`side_kernels` (the drafter compile beside the target: its seconds and the Triton kernels it
compiled) and `target_s` (the target's warm-up, its fused layers' compile included), the two
halves that run side by side; `warmup_s`, the drafters' warm-up after them; `transformers_s`,
the build's import of transformers, host-bound work that the engine's compiled code does not
change: where two rows differ in it, the host ran at another speed between them. The row of
the start that ran the job says when its first step came: `to_first_step_s` from the job's
start, `first_step_s` of it the step itself.

--gil SECONDS samples the daemon with `py-spy record --gil` (pip install -e ".[bench]": the `bench`
extra) for that long from the job's 20th step: the share of time some thread of the daemon held
the GIL (samples recorded / samples taken), and how that time splits between the target's
capture, the drafter step and the rest. The job must run that long past step 20 (--steps).

The step figures (step_ms, tokens_per_s) are the job's steady steps: from step 11 to before the
last QUEUE_DEPTH + 1, which run after the target has captured all the data (drain_step_ms: their
median, the drafter's step with no capture beside it). A job of 15 steps or fewer has none
(a start-time measurement such as `--steps 10 --warm-starts 4`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import QWEN3_8B, out_dir, print_table, write_target_dir
from dflash_core.data_home import BYTECODE_DIR
from dflash_core.engine.compile import TRITON_KERNELS_DIR
from dflash_core.engine.pipeline import QUEUE_DEPTH
from service.demo import free_port, stop_daemon


def parse_env(spec: str) -> dict[str, str]:
    """'A=1 B=2' -> {'A': '1', 'B': '2'}"""
    pairs = [item.partition("=") for item in spec.split()]
    bad = [k for k, eq, _ in pairs if not eq or not k]
    if bad:
        raise SystemExit(f"--warm-env: {bad[0]!r} is not NAME=VALUE")
    return {k: v for k, _, v in pairs}


def cache_env(inductor_cache: Path) -> dict[str, str]:
    """The environment of the bench's daemon and precompile processes. The cache directory is set
    here, not inherited: gpu_session.sh exports one for the whole call, which the engine's
    inductor_cache_dir (a default) would not override, so "cold" would not be. Triton's beside it
    where the engine puts it (the hand-written Triton kernels too), so `serve --config` on the same
    config (such as bench.startup_profile's) finds the same caches."""
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(inductor_cache),
        TRITON_CACHE_DIR=str(inductor_cache / TRITON_KERNELS_DIR),
    )


def start(config: Path, log: Path, inductor_cache: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--config", str(config)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=cache_env(inductor_cache) | (extra_env or {}),
    )


# the daemon's import chain, under its rule for where bytecode is kept (service.bytecode)
FILL_BYTECODE = """
import sys
from pathlib import Path
from service.bytecode import use_bytecode_cache
use_bytecode_cache(Path(sys.argv[1]))
import uvicorn, service.app, service.cli_local, torch, dflash_core.engine, torch._dynamo
import torch._inductor.compile_fx, torch.nn.attention.flex_attention
from transformers import AutoConfig, AutoTokenizer, AutoModelForCausalLM, Qwen3ForCausalLM
"""


def fill_bytecode(directory: Path) -> float:
    """Compile the daemon's import chain's bytecode where the daemon keeps it, as an image build's
    install does (its seconds): a cold start then finds only the compile caches empty."""
    t = time.time()
    subprocess.run([sys.executable, "-c", FILL_BYTECODE, str(directory)], check=True)
    return round(time.time() - t, 1)


def run_precompile(config: Path, log: Path, inductor_cache: Path, name: str = "precompile") -> dict:
    """`dflash-trainer precompile` on the config with start()'s cache variables: its row, named
    `name`."""
    t = time.time()
    with log.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "precompile", "--config", str(config)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=cache_env(inductor_cache),
        )
    if done.returncode != 0:
        raise SystemExit(f"precompile exited with {done.returncode}: see {log}")
    return {"cache": name, "ready_s": round(time.time() - t, 1)} | log_figures(log)


def log_figures(log: Path) -> dict:
    """From a daemon's log: the drafters' warm-up seconds and inductor's graph-cache hits and
    misses during it (the engine's `drafter warm-up compiles` lines, summed over drafter GPUs);
    the compiles beside the target (`drafter compiled beside the target`: side_s, the longest
    child's seconds; side_kernels, the most kernels a child compiled; side_failed, children that
    failed); target_s and transformers_s from the build timeline (build_phases); and the job's
    first step (`job's first step`: first_step_s, and to_first_step_s from the job's start). A
    cold start's two halves: side_s and target_s."""
    out: dict = {}
    if not log.is_file():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if "engine build timeline" in line:
            out |= build_phases(line)
            continue
        fields = dict(item.partition("=")[::2] for item in line.split() if "=" in item)
        if "job's first step" in line:
            if "first_step_s" in fields and "total_s" in fields:
                out["first_step_s"] = float(fields["first_step_s"])
                out["to_first_step_s"] = float(fields["total_s"])
            continue
        if "drafter compiled beside the target" in line or "drafter compile beside the target failed" in line:
            if fields.get("ok") == "True":
                out["side_s"] = max(out.get("side_s", 0.0), float(fields.get("seconds", 0)))
                kernels = int(float(fields.get("async_compile_cache_miss", 0)))
                out["side_kernels"] = max(out.get("side_kernels", 0), kernels)
            else:
                out["side_failed"] = out.get("side_failed", 0) + 1
        elif "drafter warm-up compiles" in line:
            for name in ("seconds", "fxgraph_cache_hit", "fxgraph_cache_miss"):
                if name in fields:
                    key = "warmup_s" if name == "seconds" else name.removeprefix("fxgraph_cache_")
                    out[key] = round(out.get(key, 0) + float(fields[name]), 2)
    return out


def build_phases(line: str) -> dict:
    """From an `engine build timeline` line: target_s, the seconds from the target's warm-up
    phase to its last device's warm target (`build:target_warm:<device>`), and transformers_s,
    from the target's loading phase to transformers imported; each left out without its events."""
    events = {}
    for item in line.split():
        label, at, t = item.rpartition("@")
        if at and label:
            try:
                events[label.removeprefix("events=")] = float(t)
            except ValueError:
                continue
    out = {}
    start = events.get("progress:warming_target:0")
    ends = [t for label, t in events.items() if label.startswith("build:target_warm:")]
    if start is not None and ends:
        out["target_s"] = round(max(ends) - start, 2)
    loading, imported = events.get("progress:loading_target:0"), events.get("build:transformers_imported")
    if loading is not None and imported is not None:
        out["transformers_s"] = round(imported - loading, 2)
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> tuple[float, list[str]]:
    t0, phases = time.time(), []
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/healthz", timeout=2)
            body = r.json()
            phase = f"{body.get('status')}:{body.get('phase', '')}:{body.get('drafters_ready', '')}"
            if not phases or phases[-1] != phase:
                phases.append(phase)
            if r.status_code == 200:
                return time.time() - t0, phases
            if body.get("status") == "failed":
                raise RuntimeError(f"warmup failed: {body.get('error')}")
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("daemon not ready in time")


def wait_buffers(url: str, timeout: float) -> float:
    """Seconds until /healthz no longer says the checkpoint buffers are pinning."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if httpx.get(url + "/healthz", timeout=5).json().get("checkpoint_buffers") != "pinning":
            return time.time() - t0
        time.sleep(0.25)
    raise TimeoutError(f"the checkpoint buffers were still pinning after {timeout:.0f} s")


def metric_samples(page: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of the named samples on a /metrics page."""
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in names
    ]


def reserved_bytes(page: str) -> dict[str, float]:
    """dflash_cuda_reserved_bytes per device."""
    return {labels["device"]: value for _, labels, value in metric_samples(page, ("dflash_cuda_reserved_bytes",))}


GIL_RATE = 200  # py-spy samples per second
WARM_STEPS = 10  # a job's first steps, left out of its step figures
DRAIN_STEPS = QUEUE_DEPTH + 1  # the captures ahead of the drafter: the queue's and the one in hand


def start_gil_sampler(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--gil",
            "--rate",
            str(GIL_RATE),
            "--duration",
            str(int(seconds)),
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def steady_window(n: int) -> slice:
    """The steps of an n-step job that measure the pipeline's steady state: from step 11 (after
    the first steps' one-time work) to before the last DRAIN_STEPS. The target's captures run that
    many micro-batches ahead of the drafter, so once the data is all captured the last steps are
    the drafter's alone, shorter than the steady step wherever the two share a GPU."""
    return slice(WARM_STEPS, max(WARM_STEPS, n - DRAIN_STEPS))


def step_figures(steps: list[dict]) -> dict:
    """step_ms (median) and tokens_per_s over the steady window; drain_step_ms, the median of the
    last DRAIN_STEPS steps (the drafter step with no capture beside it)."""
    steady = [s for s in steps[steady_window(len(steps))] if s.get("step_seconds")]
    drain = [s["step_seconds"] for s in steps[-DRAIN_STEPS:] if s.get("step_seconds")]
    secs = [s["step_seconds"] for s in steady]
    toks = sum(s.get("context_tokens") or 0 for s in steady)
    return {
        "step_ms": round(1000 * statistics.median(secs), 1) if secs else None,
        "tokens_per_s": round(toks / sum(secs)) if secs else None,
        "drain_step_ms": round(1000 * statistics.median(drain), 1) if drain else None,
    }


def gil_share(raw: Path, seconds: float) -> dict[str, float]:
    """From py-spy's raw (collapsed) stacks: percent of the time the GIL was held, in all and by
    where. Per pipeline: the target's capture, the drafter's forward and backward, its optimizer
    step, building micro-batches and the engine's per-step work; per process: the rest (HTTP,
    events, metrics). The heaviest stacks of the engine and the rest go to gil_top.txt beside."""
    where = {"target_capture": 0, "forward_backward": 0, "optimizer": 0, "data": 0, "engine": 0, "other": 0}
    heavy: dict[str, Counter] = {"engine": Counter(), "other": Counter()}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        if "capture (" in stack and "target.py" in stack:
            key = "target_capture"
        elif "clip_and_step" in stack:
            key = "optimizer"
        # the backward runs on the autograd engine's thread: its stacks start at BackwardCFunction
        elif any(k in stack for k in ("_micro_steps", "BackwardCFunction", "backward (")):
            key = "forward_backward"
        elif "dflash_core/data/" in stack:
            key = "data"
        elif "dflash_core/engine/" in stack:
            key = "engine"
        else:
            key = "other"
        where[key] += n
        if key in heavy:
            frames = [f for f in stack.split(";") if "(" in f]
            heavy[key][" < ".join(reversed(frames[-4:]))] += n
    taken = GIL_RATE * seconds
    with open(raw.with_name("gil_top.txt"), "w") as f:
        for key, counter in heavy.items():
            f.write(f"## {key}\n")
            for stack, n in counter.most_common(25):
                f.write(f"{100 * n / taken:6.2f} %  {stack}\n")
    shares = {k: round(100 * v / taken, 2) for k, v in where.items()}
    return {
        "gil_pct": round(100 * sum(where.values()) / taken, 2),
        "gil_pct_pipeline": round(sum(v for k, v in shares.items() if k != "other"), 2),
    } | {f"gil_pct_{k}": v for k, v in shares.items()}


def start_names(cold: int, warm: int) -> list[str]:
    """The starts in order: the cold ones ("cold", or "cold1".. where there are several), then the
    warm ones ("warm", or "warm1"..)."""
    colds = ["cold"] if cold == 1 else [f"cold{i + 1}" for i in range(cold)]
    return colds + (["warm"] if warm == 1 else [f"warm{i + 1}" for i in range(warm)])


def empty_caches(work: Path, bytecode_kept: bool) -> float | None:
    """What a cold start finds: no compiled kernels and no libraries' Python bytecode (the daemon
    keeps it in the data directory where it cannot keep it beside the sources), or with
    bytecode_kept that bytecode compiled again (the seconds it took)."""
    shutil.rmtree(work / "inductor", ignore_errors=True)
    shutil.rmtree(work / "data" / BYTECODE_DIR, ignore_errors=True)
    return fill_bytecode(work / "data" / BYTECODE_DIR) if bytecode_kept else None


def cold_label(phase: str, precompile: bool, bytecode_kept: bool) -> str:
    """A cold start's row name: what its caches held."""
    if precompile:
        return "after precompile" if phase == "cold" else f"after precompile ({phase})"
    return f"{phase} (bytecode kept)" if bytecode_kept else phase


def median_rows(rows: list[dict], variants: list[str]) -> list[dict]:
    """The median of the cold starts' ready_s where there are several, and of the warm starts'
    per --warm-env variant."""
    medians = []
    colds = [r["ready_s"] for r in rows if r.get("cold_start")]
    if len(colds) > 1:
        medians.append({"cache": f"cold median of {len(colds)}", "ready_s": round(statistics.median(colds), 1)})
    for variant in variants:
        warm = sorted(
            r["ready_s"] for r in rows if r["cache"].startswith("warm") and r.get("env", "-") == (variant or "-")
        )
        if len(warm) > 1:
            median = {"cache": f"warm median of {len(warm)}", "ready_s": round(statistics.median(warm), 1)}
            medians.append(median | ({"env": variant or "-"} if len(variants) > 1 else {}))
    return medians


@dataclass(frozen=True)
class Bench:
    """Where the daemon of the starts runs: its config, the bench's work directory, its URL, and
    $OUT."""

    config: Path
    work: Path
    url: str
    out: Path


def start_row(label: str, ready_s: float, log: Path, job: Callable[[], dict] | None) -> dict:
    """A start's row: its time to ready, the job's fields where it runs one (job()), and the
    figures of its log (log_figures), read after the job, whose first step the log says."""
    row: dict = {"cache": label, "ready_s": round(ready_s, 1)}
    if job is not None:
        row |= job()
    return row | log_figures(log)


def run_starts(
    args: argparse.Namespace, starts: list[str], variants: list[str], bench: Bench, record: dict
) -> list[dict]:
    """Each start in turn (start_names): the daemon to ready, the job after the first, its
    /metrics; a row each (a cold one marked `cold_start`)."""
    rows: list[dict] = []
    envs = {v: parse_env(v) for v in variants}
    out = bench.out
    for n, phase in enumerate(starts):
        cold = phase.startswith("cold")
        if cold:
            fill = empty_caches(bench.work, args.bytecode_kept)
            if fill is not None:
                record.setdefault("bytecode_fill_s", []).append(fill)
            if args.precompile:
                label, log = (
                    ("precompile", "precompile.log")
                    if phase == "cold"
                    else (f"precompile ({phase})", f"precompile_{phase}.log")
                )
                rows.append(run_precompile(bench.config, out / log, bench.work / "inductor", label))
        variant = "" if cold else variants[(n - args.cold_starts) % len(variants)]
        proc = start(bench.config, out / f"daemon_{phase}.log", bench.work / "inductor", envs[variant])
        try:
            ready_s, progress = wait_ready(bench.url, proc, args.timeout)
            label = cold_label(phase, args.precompile, args.bytecode_kept) if cold else phase
            # the job: after the first cold start only
            job = (lambda: run_job(args, bench.url, proc, out, record)) if n == 0 else None
            row = start_row(label, ready_s, out / f"daemon_{phase}.log", job)
            if len(variants) > 1:
                row["env"] = variant or "-"
            record[f"phases_{phase}"] = progress
            metrics = httpx.get(bench.url + "/metrics", timeout=10).text
            (out / f"metrics_{phase}.txt").write_text(metrics)
            for name, labels, val in metric_samples(
                metrics, ("dflash_cuda_reserved_bytes", "dflash_compiles_total", "dflash_cuda_alloc_retries_total")
            ):
                key = name.removeprefix("dflash_") + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                row[key] = round(val / 2**30, 2) if "bytes" in name else val
            print(json.dumps(row), flush=True)
            rows.append(row | ({"cold_start": True} if cold else {}))
        finally:
            stop_daemon(proc, timeout=60)
    return rows


def run_job(args: argparse.Namespace, url: str, proc: subprocess.Popen, out: Path, record: dict) -> dict:
    """The job on a ready daemon, followed to its end: its row's fields (step figures, reserved
    memory's swing, the GIL's shares); its events' figures go into `record`."""
    row: dict = {}
    if not args.job_at_ready:
        row["pinned_s"] = round(wait_buffers(url, args.timeout), 1)
    answer = httpx.post(
        url + "/jobs",
        json={
            "name": "gpu-100",
            "datasets": ["builtin://train"],
            "steps": args.steps,
            "checkpoint_interval": 50,
            "learning_rate": 6e-4,
            **json.loads(args.job_extra),
        },
        timeout=10,
    )
    if answer.status_code >= 400:  # the daemon's reason, not a KeyError on a missing id
        raise SystemExit(f"the daemon refused the job: HTTP {answer.status_code}: {answer.text[:2000]}")
    job = answer.json()
    steps, reserved = [], {}  # reserved: device -> bytes sampled after every step from step 11 on
    sampler = None
    with httpx.stream("GET", f"{url}/jobs/{job['id']}/events?follow=true", timeout=None) as r:
        for line in r.iter_lines():
            if line.strip():
                ev = json.loads(line)
                if ev.get("kind") == "step":
                    steps.append(ev)
                    if args.gil and len(steps) == 20:
                        sampler = start_gil_sampler(proc.pid, args.gil, out / "gil.txt")
                    sampling = sampler is not None and sampler.poll() is None
                    # no per-step scrape while the GIL is sampled: a scrape per step is
                    # the bench's load, not a production Prometheus's
                    if len(steps) > 10 and not sampling:
                        for dev, val in reserved_bytes(httpx.get(url + "/metrics", timeout=10).text).items():
                            reserved.setdefault(dev, []).append(val)
    record["reserved_during_job"] = {
        dev: {
            "samples": len(v),
            "min_gib": round(min(v) / 2**30, 3),
            "max_gib": round(max(v) / 2**30, 3),
            "swing_pct": round(100 * (max(v) - min(v)) / (max(v) or 1), 3),
            # (sample index, GiB) where the value changed: when a growth happened
            "changes": [(i, round(x / 2**30, 3)) for i, x in enumerate(v) if i == 0 or x != v[i - 1]],
        }
        for dev, v in reserved.items()
    }
    for dev, st in record["reserved_during_job"].items():
        row[f"job_reserved_swing_pct[{dev}]"] = st["swing_pct"]
    if sampler is not None:
        sampler.wait(timeout=args.gil + 60)
        if (out / "gil.txt").is_file():
            row.update(gil_share(out / "gil.txt", args.gil))
    final = httpx.get(f"{url}/jobs/{job['id']}", timeout=10).json()
    record["job"] = final
    record["step_seconds"] = [s.get("step_seconds") for s in steps]  # every step's, in order
    row.update(state=final.get("state"), steps=len(steps), **step_figures(steps))
    return row


def main(argv=None):
    import torch

    p = argparse.ArgumentParser()
    p.add_argument(
        "--anchors", type=int, default=256, help="512 = recipe density at S=3072; 256 = 1 anchor per 12 tokens"
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for /healthz 200")
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--two-drafters", action="store_true", help="drafters on cuda:0 and cuda:1 (target on cuda:0)")
    p.add_argument("--warm-starts", type=int, default=1, help="warm restarts after the cold start (median reported)")
    p.add_argument("--cold-starts", type=int, default=1, help="cold starts, each on emptied caches (median reported)")
    p.add_argument(
        "--warm-env",
        default="",
        help='environments the warm starts take turns with, ";"-separated '
        '("NAME=VALUE NAME2=VALUE"; empty = unchanged)',
    )
    p.add_argument("--gil", type=float, default=0, help="seconds of py-spy GIL sampling during the job (0: none)")
    p.add_argument(
        "--block-size", type=int, default=16, help="0: the recipe's default (a dspark daemon refuses any but 7)"
    )
    p.add_argument(
        "--job-at-ready",
        action="store_true",
        help="submit the job at ready, beside the pinning of the checkpoint buffers (default: once they are pinned)",
    )
    p.add_argument(
        "--precompile",
        action="store_true",
        help="run `dflash-trainer precompile` on the empty caches first: the first start is then the one after it",
    )
    p.add_argument(
        "--bytecode-kept",
        action="store_true",
        help="the cold start with the libraries' bytecode compiled (as in the image the Dockerfile builds): "
        "only the compile caches empty",
    )
    p.add_argument("--engine-extra", default="", help='more [engine] lines, e.g. "teacher = true"')
    p.add_argument("--job-extra", default="{}", help='more job fields as JSON, e.g. \'{"loss": "kl"}\'')
    args = p.parse_args(argv)
    if args.cold_starts < 1:
        p.error("--cold-starts must be at least 1: the job runs after the first cold start")
    work = Path(os.environ.get("DAEMON_WORK", "/tmp/dflash-daemon-gpu"))
    work.mkdir(parents=True, exist_ok=True)
    target = write_target_dir(work / "target", QWEN3_8B)
    gpus = torch.cuda.device_count()
    drafter_dev = "cuda:1" if gpus >= 2 and not args.colocated else "cuda:0"
    drafter_devs = '"cuda:0", "cuda:1"' if args.two_drafters and gpus >= 2 else f'"{drafter_dev}"'
    port = free_port()
    config = work / "config.toml"
    config.write_text(f"""
port = {port}
data_dir = "{work / "data"}"

[engine]
target_path = "{target}"
target_random_init = true
target_devices = ["cuda:0"]
drafter_devices = [{drafter_devs}]
seq_len = 3072
num_anchors = {args.anchors}
{f"block_size = {args.block_size}" if args.block_size else ""}
drafter_layers = {args.layers}
target_layer_ids = [1, 9, 17, 25, 33]
inductor_cache_dir = "{work / "inductor"}"
{args.engine_extra}
""")
    url = f"http://127.0.0.1:{port}"
    out = out_dir()
    record: dict = {"args": vars(args), "drafter_device": drafter_dev}
    variants = [v.strip() for v in args.warm_env.split(";")] if args.warm_env else [""]
    starts = start_names(args.cold_starts, args.warm_starts)
    try:
        rows = run_starts(args, starts, variants, Bench(config, work, url, out), record)
    finally:
        # the job's output under the data directory's default: its checkpoint holds the drafter's
        # whole training state, large at the reference shape, and bench runs one after the other
        # on one machine would fill its disk
        shutil.rmtree(work / "data" / "jobs", ignore_errors=True)
    rows += median_rows(rows, variants)
    for row in rows:
        row.pop("cold_start", None)
    record["rows"] = rows
    (out / "daemon_gpu.json").write_text(json.dumps(record, indent=1, default=str))
    warm = [name for name in starts if name.startswith("warm")]
    print(json.dumps(record.get(f"phases_{starts[0]}")), json.dumps(record.get(f"phases_{warm[-1]}") if warm else None))
    cols = sorted(
        {k for r in rows for k in r},
        key=lambda k: (k not in ("cache", "env", "ready_s", "state", "steps", "step_ms", "tokens_per_s"), k),
    )
    print_table(rows, cols)


if __name__ == "__main__":
    main()
