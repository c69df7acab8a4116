"""Cold-cache warmup + 50 training steps, 5 times in a row, each in a fresh process.

    python -m bench.engine_soak [--trials 5] [--steps 50] [--timeout 300]

Each trial: a new inductor cache directory, an Engine with a random-weight target on cuda:0 and
one drafter replica per GPU (4 replicas on cuda:0 when there is one GPU), 50 steps of the bundled
dataset. Reports time to ready, train time, compile counts by phase, and hangs (timeouts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(steps: int, work: Path) -> None:
    import torch

    from bench.common import dims, random_target_engine_config, write_target_dir
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import Engine, JobCallbacks, TrainJob

    gpus = torch.cuda.device_count()
    drafters = [f"cuda:{i}" for i in range(gpus)] if gpus >= 2 else ["cuda:0"] * 4
    assets = ensure_default_assets(work / "data")
    target = write_target_dir(work / "target", **dims(2048, 6144, 12, 16, 8, 128))
    cfg = random_target_engine_config(target, drafters, 2048, 256, drafter_layers=3, target_layer_ids=[1, 5, 9])
    t0 = time.time()
    engine = Engine(cfg, work / "data").build()
    ready = time.time() - t0
    stats = []

    class CB(JobCallbacks):
        def on_step(self, s):
            stats.append(s)

    t1 = time.time()
    res = engine.run_job(
        TrainJob(
            datasets=[str(assets.train)],
            output_dir=str(work / "out"),
            steps=steps,
            learning_rate=1e-3,
            checkpoint_interval=steps,
        ),
        CB(),
    )
    train = time.time() - t1
    same = all(
        torch.equal(a.cpu(), b.cpu())
        for rep in engine.replicas[1:]
        for a, b in zip(engine.replicas[0].drafter.parameters(), rep.drafter.parameters())
    )
    print(
        json.dumps(
            {
                "status": res.status,
                "steps": res.steps_done,
                "ready_s": round(ready, 1),
                "train_s": round(train, 1),
                "compiles": engine.status().compiles,
                "replicas": len(drafters),
                "replicas_identical": same,
                "tokens_per_s": round(
                    sum(s.context_tokens for s in stats[5:]) / max(1e-9, sum(s.step_seconds for s in stats[5:]))
                ),
            }
        ),
        flush=True,
    )
    engine.close()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--child", type=Path)
    args = p.parse_args(argv)
    if args.child:
        child(args.steps, args.child)
        return
    rows = []
    for trial in range(args.trials):
        work = Path(tempfile.mkdtemp(prefix="soak-"))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-cold"), PYTHONUNBUFFERED="1")
        t0 = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.engine_soak", "--child", str(work), "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
            row = json.loads(line) if line else {"status": f"CRASH exit {proc.returncode}", "error": proc.stderr[-300:]}
        except subprocess.TimeoutExpired:
            row = {"status": "HUNG"}
        row.update(trial=trial + 1, wall_s=round(time.time() - t0, 1))
        if isinstance(row.get("compiles"), dict):
            row["warmup_compiles"], row["runtime_compiles"] = row["compiles"]["warmup"], row["compiles"]["runtime"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from bench.common import out_dir, print_table

    (out_dir() / "engine_soak.json").write_text(json.dumps(rows, indent=1))
    print_table(
        rows,
        [
            "trial",
            "status",
            "steps",
            "replicas",
            "ready_s",
            "train_s",
            "warmup_compiles",
            "runtime_compiles",
            "replicas_identical",
            "tokens_per_s",
            "wall_s",
        ],
    )


if __name__ == "__main__":
    main()
