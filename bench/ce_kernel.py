"""One lm_head + CE loss chunk at the reference shape, alone, on one GPU: the inductor-compiled
chunk against the two-pass Triton kernel of dflash_core/kernels/ce.py (the engine's CUDA path)
over a few launch settings.

    python -m bench.ce_kernel [--rows 1920]

A chunk is logits = hidden @ W^T, CE + logits gradient, grad_hidden = grad @ W (W: [151936, 4096]
bf16, rows = 1920: the reference step's near-equal chunks of 7680 predicted rows). Medians of 20
CUDA-event timings after 3 warm-up calls, under bf16 autocast as in the step; random inputs.
The "CE only" column subtracts the two GEMMs timed alone. Writes $OUT/ce_kernel.json, prints a table.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import cuda_time_ms, env_record, median, report
from dflash_core.kernels import ce as ce_triton
from dflash_core.step.loss import compiled_chunk_loss

SWEEP = [(ce_triton.BLOCK_V, ce_triton.NUM_WARPS), (2048, 8), (4096, 4), (4096, 16), (8192, 8)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1920)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    w = torch.rand(args.rows, device="cuda", generator=g)
    w = w / w.sum()

    def timed(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return round(median(cuda_time_ms(fn, warmup=3, iters=20)), 3)

    gemms = timed(lambda: (hidden @ weight.t()) @ weight)
    compiled = compiled_chunk_loss()
    rows = [{"chunk": "compiled (inductor)", "ms": timed(lambda: compiled(hidden, weight, labels, w, True))}]
    for block_v, warps in dict.fromkeys(SWEEP):
        rows.append(
            {
                "chunk": f"triton, BLOCK_V {block_v}, {warps} warps",
                "ms": timed(
                    lambda: ce_triton.chunk_loss_and_grad(
                        hidden, weight, labels, w, True, block_v=block_v, num_warps=warps
                    )
                ),
            }
        )
    for row in rows:
        row["CE only (minus the GEMMs)"] = round(row["ms"] - gemms, 3)
    rows.append({"chunk": "the two GEMMs alone", "ms": gemms})
    env = env_record()
    report(
        "ce_kernel",
        {"env": env, "args": vars(args), "rows": rows},
        f"One loss chunk, {env['gpu']}, torch {env['torch']}: [{args.rows}, {args.hidden}] x [{args.vocab}, {args.hidden}] bf16",
        rows,
        ["chunk", "ms", "CE only (minus the GEMMs)"],
    )


if __name__ == "__main__":
    main()
