"""What ingesting records costs a continual job's training: its step time on the embedded default
(CPU), with a backlog large enough that it never waits for data, while a writer process appends
RATE records per second to a watched JSONL file in windows that alternate with windows of
nothing arriving.

    python -m bench.continual_ingest [--steps 600] [--rate 1000] [--window 2] [--device cuda | --reference]
        [--data-dir DIR]
    python -m bench.continual_ingest --per-record [--records 5000]
    python -m bench.continual_ingest --burst 20000 [--steps 300]

The two conditions take turns every `--window` seconds inside one job, since a CPU host's step
rate drifts from minute to minute by more than the cost being measured: separate phases of a
minute each read costs from -6 % to +22 % for the same code. A step counts for the window it
ran in; steps that cross a window's edge, or start within `--settle` seconds of it (the last
poll's records of a busy window are still being read), count for neither, nor do the first
`--warmup` seconds (the backlog's first read). The writer is a process of its own, as a serving
stack's or an RL trainer's would be. Prints one JSON line per window kind (median step, steps,
records written and ingested) and the cost: 1 - the quiet windows' median step over the busy
windows'.

`--device` runs the target and the drafter there (default: the CPU); on a GPU the step's kernels
let go of the GIL, so what remains of the cost is the host's share of the step against the ingest
thread's. `--reference` (on cuda:0) trains at the reference shape instead of the embedded default:
a random-weight Qwen3-8B-shaped target, a 5-layer drafter, 3,072 context tokens and 512 anchors
in blocks of 16, FP8 drafter and target; its records are the same conversations.

`--burst N` drops one file of N records into the watched source once the warm-up has passed (no
writer, no windows) and prints the steps around it: the median step before it, the steps while
the ingest thread works through it, the longest of them and its excess over that median. What a
large file costs the job's thread beside the ingest's CPU: a wait for the ingest thread shows
there as a step of about the file's whole ingest.

`--per-record` times the ingest thread's own work instead, without training beside it: one poll
of a JSONL file of `--records` records through the job's feed (read, parse, chat template,
tokenize, loss mask, into the pool), CPU seconds of the polling thread per record, the median
of five files after one more.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRITER = """
import json, sys, time
path, rate, window, t0 = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
written = 0
with open(path, "a") as f:
    while True:
        now = time.time() - t0
        if int(now // window) % 2 == 1:  # busy windows are the odd ones
            start = int(now // window) * window
            due = int((now - start) * rate) - written
            if due > 0:
                for k in range(due):
                    i = 10**6 + written + k
                    turns = [{"role": "user", "content": f"What is {i % 97} plus {i % 13}?"},
                             {"role": "assistant", "content": f"{i % 97} plus {i % 13} is {i % 97 + i % 13}. Anything else?"}]
                    f.write(json.dumps({"messages": turns}) + "\\n")
                f.flush()
                written += due
                print(written, flush=True)
        else:
            written = 0
        time.sleep(0.01)
"""


def conversation(i: int) -> str:
    turns = [
        {"role": "user", "content": f"What is {i % 97} plus {i % 13}?"},
        {"role": "assistant", "content": f"{i % 97} plus {i % 13} is {i % 97 + i % 13}. Anything else?"},
    ]
    return json.dumps({"messages": turns}) + "\n"


def classify(steps: list[tuple[float, float]], window: float, settle: float, warmup: float) -> dict[str, list[float]]:
    """Step durations (s) by the window they ran in, from (start, end) seconds since the windows
    began: 'quiet' (even windows) and 'busy' (odd ones)."""
    kinds: dict[str, list[float]] = {"quiet": [], "busy": []}
    for start, end in steps:
        index = int(start // window)
        if start < warmup or int(end // window) != index or start - index * window < settle:
            continue
        kinds["busy" if index % 2 else "quiet"].append(end - start)
    return kinds


def backlog_records(args: argparse.Namespace) -> int:
    """New records enough for every step (a step packs about 20 of these records at 512 context
    tokens, about 120 at the reference shape's 3,072), so the job never waits for data."""
    return args.steps * (120 if args.reference else 20)


def training_job(work: Path, source: Path):
    """A continual job on `source` that trains on without publishing or checkpointing."""
    from dflash_core.continual.job import ContinualJob

    return ContinualJob(
        datasets=[],
        output_dir=str(work / "out"),
        sources=[str(source)],
        publish_dir=str(work / "out" / "published"),
        publish_every_steps=10**6,
        checkpoint_interval=10**6,
        replay_ratio=0.5,
        poll_seconds=0.2,
        max_pending_records=10**7,
    )


def run(engine, work: Path, args: argparse.Namespace) -> dict:
    from dflash_core.engine import JobCallbacks

    source = work / "source"
    source.mkdir()
    # a backlog of new records for every step, so the job never waits for data
    (source / "backlog.jsonl").write_text("".join(conversation(i) for i in range(backlog_records(args))))
    ends: list[float] = []

    class Callbacks(JobCallbacks):
        ingested = 0

        def on_step(self, stats) -> None:
            ends.append(time.time())

        def on_records(self, progress) -> None:
            self.ingested = int(progress["ingested"])

        def should_cancel(self) -> bool:
            return len(ends) >= args.steps

    job = training_job(work, source)
    t0 = time.time()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(source / "live.jsonl"), str(args.rate), str(args.window), str(t0)],
        stdout=subprocess.DEVNULL,
    )
    callbacks = Callbacks()
    try:
        engine.run_job(job, callbacks)
    finally:
        writer.kill()
        writer.wait()
    live = source / "live.jsonl"
    written = live.read_bytes().count(b"\n") if live.exists() else 0
    steps = [(a - t0, b - t0) for a, b in itertools.pairwise(ends)]
    kinds = classify(steps, args.window, args.settle, args.warmup)
    medians = {k: statistics.median(v) for k, v in kinds.items() if v}
    for kind, durations in kinds.items():
        median = medians.get(kind)
        print(
            json.dumps({"windows": kind, "steps": len(durations), "median_step_ms": median and round(median * 1e3, 2)})
        )
    cost = 1 - medians["quiet"] / medians["busy"] if len(medians) == 2 else None
    return {
        "rate": args.rate,
        "records_written": written,
        "ingested": callbacks.ingested,
        "step_rate_cost": cost if cost is None else round(cost, 4),
    }


def burst(engine, work: Path, args: argparse.Namespace) -> dict:
    from dflash_core.engine import JobCallbacks

    source = work / "source"
    source.mkdir()
    backlog = backlog_records(args)
    (source / "backlog.jsonl").write_text("".join(conversation(i) for i in range(backlog)))
    # written now under a dot name (the watcher leaves those alone), dropped in by a rename
    hidden = source / ".burst.jsonl"
    hidden.write_text("".join(conversation(backlog + i) for i in range(args.burst)))
    ends: list[float] = []
    marks: dict[str, float] = {}

    class Callbacks(JobCallbacks):
        def on_step(self, stats) -> None:
            ends.append(time.time())
            if "dropped" not in marks and ends[-1] - ends[0] >= args.warmup:
                hidden.rename(source / "burst.jsonl")
                marks["dropped"] = time.time()

        def on_records(self, progress) -> None:
            if "dropped" in marks and "ingested" not in marks and int(progress["ingested"]) >= backlog + args.burst:
                marks["ingested"] = time.time()

        def should_cancel(self) -> bool:
            return len(ends) >= args.steps

    job = training_job(work, source)
    engine.run_job(job, Callbacks())
    if "ingested" not in marks:
        raise SystemExit("the job ended before the burst was ingested: more --steps")
    return {"burst_records": args.burst, **around(ends, marks["dropped"], marks["ingested"], args.warmup)}


def around(ends: list[float], dropped: float, ingested: float, warmup: float) -> dict:
    """The steps (from their end times) before a file was dropped in, from half the warm-up on,
    against those that overlap its ingest, from `dropped` to `ingested`."""
    steps = list(itertools.pairwise(ends))
    before = [b - a for a, b in steps if ends[0] + warmup / 2 <= a and b <= dropped]
    during = [b - a for a, b in steps if a < ingested and b > dropped]
    median = statistics.median(before)
    return {
        "ingest_s": round(ingested - dropped, 3),
        "median_step_ms_before": round(median * 1e3, 2),
        "steps_during": len(during),
        "median_step_ms_during": round(statistics.median(during) * 1e3, 2),
        "longest_step_ms_during": round(max(during) * 1e3, 2),
        "longest_excess_ms": round((max(during) - median) * 1e3, 2),
    }


def per_record(data: Path, records: int) -> dict:
    from transformers import AutoTokenizer

    from dflash_core.continual.feed import Feed
    from dflash_core.continual.replay import RecordPool
    from dflash_core.continual.sources import SourceWatcher
    from dflash_core.data.tokenize import ChatTemplate
    from dflash_core.defaults import ensure_default_assets

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_assets(data).target))
    cpu_us = []
    for i in range(6):
        source = data / f"per-record-{i}"
        source.mkdir()
        (source / "records.jsonl").write_text("".join(conversation(k) for k in range(records)))
        watcher = SourceWatcher([(source, str(source), [str(data)])], None)
        feed = Feed(watcher, RecordPool(512, records, 32, 50), tokenizer, ChatTemplate(), 0.2, None, 10**9)
        t = time.thread_time()
        added = feed.poll_once()
        cpu_us.append((time.thread_time() - t) / max(1, added) * 1e6)
    return {"records": records, "cpu_us_per_record": round(statistics.median(cpu_us[1:]), 1)}


def engine_config(args: argparse.Namespace, data: Path):
    from dflash_core.engine import EngineConfig

    if not args.reference:
        return EngineConfig(drafter_devices=[args.device], target_devices=[args.device])
    from bench.common import random_target_engine_config, write_target_dir

    return random_target_engine_config(
        write_target_dir(data / "reference-target"),
        ["cuda:0"],
        3072,
        512,
        drafter_layers=5,
        target_layer_ids=[1, 9, 17, 25, 33],
        precision="fp8",
        target_precision="fp8",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rate", type=int, default=1000, help="records per second appended in busy windows")
    parser.add_argument("--window", type=float, default=2.0, help="seconds of each window")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds at a window's start that count for neither")
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds at the start that count for neither")
    parser.add_argument("--per-record", action="store_true", help="the ingest thread's CPU per record, alone")
    parser.add_argument("--records", type=int, default=5000, help="records per file with --per-record")
    parser.add_argument("--burst", type=int, default=0, help="records of the one file dropped in (no windows)")
    parser.add_argument("--device", default="cpu", help="where the target and the drafter run, e.g. cuda:0")
    parser.add_argument("--reference", action="store_true", help="the reference shape on cuda:0 (FP8)")
    parser.add_argument("--data-dir", help="default: a temporary directory")
    args = parser.parse_args(argv)
    if args.per_record:
        with tempfile.TemporaryDirectory(prefix="dflash-continual-") as tmp:
            print(json.dumps(per_record(Path(args.data_dir or tmp), args.records)), flush=True)
        return
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import Engine

    with tempfile.TemporaryDirectory(prefix="dflash-continual-") as tmp:
        data = Path(args.data_dir or tmp)
        ensure_default_assets(data)
        engine = Engine(engine_config(args, data), data).build()
        try:
            print(json.dumps((burst if args.burst else run)(engine, Path(tmp), args)), flush=True)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
