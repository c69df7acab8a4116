"""Why the engine warms up in one thread first: reproduces the first-compile race.

    python -m bench.naive_threads [--threads 4] [--timeout 150]

Runs two children, each with a cold inductor cache, under a timeout:
  naive   K threads each first-call the compiled flex_attention drafter step (forward+backward)
          at the same moment (threads spread over the GPUs);
  warmed  the same, after one forward+backward per GPU in the main thread (what the engine does).
Prints, per mode, how many threads finished, errors, wall time, or that it hung.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def child(mode: str, threads: int) -> None:
    import torch

    from bench.common import dims
    from dflash_core.config import DrafterConfig, ShapeConfig
    from dflash_core.data.batches import synthetic_micro_batch
    from dflash_core.drafter import FrozenHead
    from dflash_core.engine.config import StepPlan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep

    cfg = DrafterConfig(
        **dims(1024, 2048, 1, 8, 4, 128),
        vocab_size=32000,
        block_size=16,
        mask_token_id=5,
        target_layer_ids=(1, 3),
        num_target_layers=8,
    )
    shape = ShapeConfig(seq_len=1024, num_anchors=64, block_size=16)
    gpus = torch.cuda.device_count()
    devices = [f"cuda:{i % gpus}" for i in range(threads)]
    head = FrozenHead(torch.randn(32000, 1024) * 0.02, torch.randn(32000, 1024) * 0.02)
    plan = StepPlan(attention="flex", compiled=True, loss="compiled", working_weights="fp32")
    reps = [DrafterReplica(i, cfg, d, head, plan, ReplicaStep(7.0, 2048)) for i, d in enumerate(devices)]
    batch = synthetic_micro_batch(shape, 32000, 0)
    inputs = [(batch.to(d), torch.randn(1024, 2 * 1024, device=d, dtype=torch.bfloat16)) for d in devices]

    def step(i):
        rep = reps[i]
        acc = rep.new_accumulator()
        rep.forward_backward(inputs[i][0], inputs[i][1], 1.0, acc)
        torch.cuda.synchronize(rep.device)

    t0 = time.time()
    if mode == "warmed":
        seen = set()
        for i, d in enumerate(devices):
            if d not in seen:
                step(i)
                seen.add(d)
    done, errors = [], []
    barrier = threading.Barrier(threads)

    def work(i):
        try:
            barrier.wait()
            step(i)
            done.append(i)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {str(e)[:300]}")

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(
        json.dumps(
            {
                "mode": mode,
                "threads": threads,
                "finished": len(done),
                "errors": errors,
                "seconds": round(time.time() - t0, 1),
            }
        ),
        flush=True,
    )


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--child", choices=["naive", "warmed"])
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.threads)
        return
    rows = []
    for mode in ("naive", "warmed"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-cold-"), PYTHONUNBUFFERED="1")
        t0 = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.naive_threads", "--child", mode, "--threads", str(args.threads)],
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
            row = (
                json.loads(line)
                if line
                else {"mode": mode, "finished": 0, "errors": [f"exit {proc.returncode}: {proc.stderr[-400:]}"]}
            )
        except subprocess.TimeoutExpired:
            row = {
                "mode": mode,
                "threads": args.threads,
                "finished": "HUNG",
                "errors": [f"no result after {args.timeout:.0f} s"],
            }
        row["wall_seconds"] = round(time.time() - t0, 1)
        rows.append(row)
    from bench.common import out_dir, print_table

    (out_dir() / "naive_threads.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        r["errors"] = "; ".join(r.get("errors", []))[:160]
    print_table(rows, ["mode", "threads", "finished", "wall_seconds", "errors"])


if __name__ == "__main__":
    main()
