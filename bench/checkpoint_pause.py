"""Checkpoint pause and final write at the reference drafter size, through the engine's own
Checkpointer on one GPU.

    python -m bench.checkpoint_pause [--layers 5] [--steps 200] [--interval 60] [--out-dir /tmp/ckpt-bench]

A replica at Qwen3-8B widths (the engine's CUDA plan: bf16 working weights, Triton AdamW) trains
on one synthetic micro-batch (S=3072, N=256 by default) and checkpoints every --interval steps.
Reported per checkpoint: the pause (how long the loop stood still: waiting for the previous
write, launching the copies), the steps around it, and how long the background write took; then
the time from the last step to the final checkpoint on disk. Writes $OUT/checkpoint_pause.json
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from bench.common import out_dir, print_table, reference_drafter_config
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.drafter import FrozenHead
from dflash_core.engine.api import JobCallbacks
from dflash_core.engine.checkpointing import Checkpointer, RunPlan
from dflash_core.engine.config import TrainJob, step_plan
from dflash_core.engine.replica import DrafterReplica, ReplicaStep


class Record(JobCallbacks):
    def __init__(self) -> None:
        self.done: dict[int, tuple[float, float]] = {}  # step -> (pause, time reported)

    def on_checkpoint(self, path: str, step: int, pause_seconds: float = 0.0) -> None:
        self.done[step] = (pause_seconds, time.monotonic())


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=60, help="steps between checkpoints (longer than a write)")
    p.add_argument("--out-dir", default="/tmp/dflash-ckpt-bench")
    args = p.parse_args(argv)
    cfg = reference_drafter_config(args.layers)
    shape = ShapeConfig(seq_len=3072, num_anchors=args.anchors, block_size=16)
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) * 0.02,
    )
    rep = DrafterReplica(0, cfg, "cuda:0", head, step_plan(["cuda:0"]), ReplicaStep(7.0, 2048))
    rep.init_weights(0)
    rep.new_optimizer(1e-4, 0.0, (0.9, 0.95))
    batch = synthetic_micro_batch(shape, cfg.vocab_size, 0).to("cuda")
    feats = torch.randn(shape.seq_len, cfg.num_target_features * cfg.hidden_size, device="cuda", generator=g)
    feats = feats.to(torch.bfloat16)
    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    job = TrainJob(
        datasets=[], output_dir=str(out), steps=args.steps, checkpoint_interval=args.interval, keep_checkpoints=2
    )
    rec = Record()
    params = sum(m.numel() for _, m in rep.named_masters())

    def step() -> float:
        t = time.monotonic()
        acc = rep.new_accumulator()
        rep.forward_backward(batch, feats, 1.0, acc)
        rep.clip_and_step(1.0, 1e-4)
        float(acc.loss_sum)  # the engine's loop reads the step's loss (a device sync) every step
        return time.monotonic() - t

    for _ in range(3):  # compile, the Triton kernels, the allocator's pools
        step()
    t0 = time.monotonic()
    ckpt = Checkpointer(
        job, rep, rec, RunPlan(total_steps=args.steps, micro_batches_per_step=1, replicas=1), target_path="bench"
    )
    prepare_s = time.monotonic() - t0
    step_times, submitted = [], {}
    for i in range(1, args.steps + 1):
        step_times.append(step())
        t = time.monotonic()
        ckpt.save(i, None)
        if ckpt.due(i):
            submitted[i] = t
    last_step_end = time.monotonic()
    ckpt.finish(args.steps, None, None, write_last=False)
    final_s = time.monotonic() - last_step_end
    med = sorted(step_times)[len(step_times) // 2]
    rows = []
    for s, (pause, reported) in sorted(rec.done.items()):
        after = step_times[s] if s < len(step_times) else None
        rows.append(
            {
                "checkpoint_step": s,
                "pause_s": round(pause, 4),
                "next_step_ms": round(1000 * after, 1) if after else None,
                "median_step_ms": round(1000 * med, 1),
                "written_after_s": round(reported - submitted.get(s, reported), 2),
            }
        )
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    record = {
        "args": vars(args),
        "params": params,
        "bytes_on_disk_last_two": size,
        "buffers_prepare_s": round(prepare_s, 3),
        "final_checkpoint_after_last_step_s": round(final_s, 2),
        "rows": rows,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    (out_dir() / "checkpoint_pause.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}))
    print(
        f"\nCheckpoint pause, {record['gpu']}, torch {torch.__version__}, {params / 1e9:.2f} B parameters "
        f"(fp32 masters + AdamW moments: {12 * params / 2**30:.1f} GiB), S=3072 N={args.anchors}; "
        f"final checkpoint on disk {final_s:.1f} s after the last step"
    )
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
