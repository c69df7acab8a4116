"""What ingesting records costs a continual job's training: its step rate on the embedded default
(CPU) with a backlog large enough that it never waits for data, first with nothing arriving,
then while a writer appends RATE records per second to a watched JSONL file.

    python -m bench.continual_ingest [--steps 60] [--rate 1000] [--data-dir DIR]

Prints one JSON line per phase (steps/s over the steps after the first few, records ingested)
and the relative cost. On a machine shared with other work, run it twice and read the spread.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def conversation(i: int) -> str:
    turns = [
        {"role": "user", "content": f"What is {i % 97} plus {i % 13}?"},
        {"role": "assistant", "content": f"{i % 97} plus {i % 13} is {i % 97 + i % 13}. Anything else?"},
    ]
    return json.dumps({"messages": turns}) + "\n"


def phase(engine, work: Path, name: str, steps: int, rate: int) -> dict:
    from dflash_core.continual.job import ContinualJob
    from dflash_core.engine import JobCallbacks

    source = work / f"source-{name}"
    source.mkdir()
    # a backlog of new records for every step, so the job never waits for data
    (source / "backlog.jsonl").write_text("".join(conversation(i) for i in range(steps * 40)))
    times: list[float] = []
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        with (source / "live.jsonl").open("a") as f:
            t0 = time.monotonic()
            while not stop.is_set():
                due = int((time.monotonic() - t0) * rate) - written[0]
                if due > 0:
                    f.write("".join(conversation(10**6 + written[0] + k) for k in range(due)))
                    f.flush()
                    written[0] += due
                time.sleep(0.01)

    class Callbacks(JobCallbacks):
        ingested = 0

        def on_step(self, stats) -> None:
            times.append(time.monotonic())

        def on_records(self, progress) -> None:
            self.ingested = int(progress["ingested"])

        def should_cancel(self) -> bool:
            return len(times) >= steps

    job = ContinualJob(
        datasets=[],
        output_dir=str(work / f"out-{name}"),
        sources=[str(source)],
        publish_dir=str(work / f"out-{name}" / "published"),
        publish_every_steps=10**6,
        checkpoint_interval=10**6,
        replay_ratio=0.5,
        poll_seconds=0.2,
        max_pending_records=10**7,
    )
    thread = threading.Thread(target=writer, daemon=True) if rate else None
    callbacks = Callbacks()
    if thread is not None:
        thread.start()
    engine.run_job(job, callbacks)
    stop.set()
    skip = min(5, len(times) - 2)
    rate_steps = (len(times) - 1 - skip) / (times[-1] - times[skip])
    return {
        "phase": name,
        "steps_per_s": round(rate_steps, 3),
        "records_written": written[0],
        "ingested": callbacks.ingested,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rate", type=int, default=1000, help="records per second appended in the second phase")
    parser.add_argument("--data-dir", help="default: a temporary directory")
    args = parser.parse_args(argv)
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="dflash-continual-") as tmp:
        data = Path(args.data_dir or tmp)
        ensure_default_assets(data)
        engine = Engine(EngineConfig(drafter_devices=["cpu"]), data).build()
        try:
            quiet = phase(engine, Path(tmp), "quiet", args.steps, 0)
            print(json.dumps(quiet), flush=True)
            busy = phase(engine, Path(tmp), f"ingest-{args.rate}", args.steps, args.rate)
            print(json.dumps(busy), flush=True)
            cost = 1 - busy["steps_per_s"] / quiet["steps_per_s"]
            print(json.dumps({"step_rate_cost": round(cost, 4)}), flush=True)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
