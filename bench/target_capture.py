"""The target's capture per micro-batch: eager forward against its CUDA graph replay.

    python -m bench.target_capture [--seq-len 3072] [--iters 30]

A Qwen3-8B-shaped target with random weights on cuda:0 captures 5 layers' outputs of packed
synthetic micro-batches (what the feature pipeline's thread does per micro-batch). For each way:
host_ms, the time the calling thread spends issuing the work (what holds the GIL), and total_ms,
until the device finished; medians after warm-up. The outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import QWEN3_8B, REFERENCE_SHAPE, env_record, out_dir, report, write_target_dir
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.target import TargetModel


def time_capture(fn, batches, iters: int) -> tuple[float, float]:
    host, total = [], []
    for i in range(iters + 3):
        args = batches[i % len(batches)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        if i >= 3:
            host.append(1000 * (issued - t))
            total.append(1000 * (done - t))
    return statistics.median(host), statistics.median(total)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=REFERENCE_SHAPE.seq_len)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    out = out_dir()
    target = TargetModel(write_target_dir(out / "target", QWEN3_8B), [1, 9, 17, 25, 33], "cuda:0", random_init=True)
    shape = ShapeConfig(seq_len=args.seq_len, num_anchors=REFERENCE_SHAPE.num_anchors, block_size=16)
    batches = []
    for seed in range(4):
        mb = synthetic_micro_batch(shape, QWEN3_8B["vocab_size"], 0, seed=seed)
        batches.append(tuple(t.to("cuda:0") for t in (mb.input_ids, mb.position_ids, mb.doc_ids)))
    eager_host, eager_total = time_capture(target._capture, batches, args.iters)
    t = time.perf_counter()
    assert target.record_graph(args.seq_len)
    record_s = time.perf_counter() - t
    same = all(torch.equal(target.capture(*b).clone(), target._capture(*b)) for b in batches)
    graph_host, graph_total = time_capture(target.capture, batches, args.iters)
    rows = [
        {"way": "eager", "host_ms": round(eager_host, 2), "total_ms": round(eager_total, 2)},
        {
            "way": "cuda_graph",
            "host_ms": round(graph_host, 2),
            "total_ms": round(graph_total, 2),
            "record_s": round(record_s, 2),
            "bit_identical": same,
        },
    ]
    report(
        "target_capture",
        {"env": env_record(), "seq_len": args.seq_len, "rows": rows},
        f"target capture per micro-batch, Qwen3-8B shape, S={args.seq_len}",
        rows,
        ["way", "host_ms", "total_ms", "record_s", "bit_identical"],
    )


if __name__ == "__main__":
    main()
