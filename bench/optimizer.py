"""The optimizer step over the drafter's parameters at the reference widths (~1.05B fp32), on
one GPU, apart from the forward and backward (the optimizer rows of docs/performance.md).

    python -m bench.optimizer [--layers 5] [--compiled]

Rows: the engine's step on CUDA (Triton AdamW over fp32 masters, reading bf16 gradients and
writing bf16 working copies of the weight matrices; alone, and clipped: norm + AdamW with the
clip folded in, what the training loop runs), the Triton AdamW over fp32 weights and gradients
(block size / warps sweep; the default first; clipped too), torch's fused
AdamW per tensor and over one flat tensor, torch's usual clip_grad_norm_ + fused step, and
(--compiled, a long cold compile) torch.compile of the foreach step. Medians of 20
CUDA-event timings after 3 warm-up steps, on random gradients. Writes $OUT/optimizer.json and
prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch

from bench.common import cuda_time_ms, env_record, median, reference_drafter_config, report
from dflash_core.drafter import DFlashDrafter
from dflash_core.engine.optim import clipped_step
from dflash_core.kernels.adamw import BLOCK, NUM_WARPS, TritonAdamW

KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
SWEEP = [(BLOCK, NUM_WARPS), (2048, 8), (2048, 4), (4096, 8), (8192, 16)]


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def working_copy_rows(params) -> dict[str, float]:
    """The engine's CUDA step (DrafterReplica's bf16 working weights): the matrices' gradients
    in bf16 on their working copies, fp32 masters; `params` keep their own gradients."""
    matrices = [p.dim() >= 2 for p in params]
    copies = [p.detach().to(torch.bfloat16) if m else None for p, m in zip(params, matrices)]
    saved = [p.grad for p in params]
    for p, w, m in zip(params, copies, matrices):
        if m:
            w.grad, p.grad = p.grad.to(torch.bfloat16), None
    opt = TritonAdamW(params, **KW, working_copies=copies)
    grads = [w.grad if m else p.grad for p, w, m in zip(params, copies, matrices)]
    rows = {
        "Triton AdamW, bf16 working copies + bf16 gradients of the matrices (engine)": median(
            cuda_time_ms(opt.step, warmup=3, iters=20)
        ),
        "engine clipped step: norm of the bf16 gradients + the same AdamW, clip folded in": median(
            cuda_time_ms(lambda: clipped_step(opt, grads, 1.0), warmup=3, iters=20)
        ),
    }
    for p, g in zip(params, saved):
        p.grad = g
    return rows


def optimizer_rows(params, compiled: bool = False) -> dict[str, float | None]:
    """Milliseconds per optimizer step by implementation, over fp32 `params` (their .grad set)."""
    rows: dict[str, float | None] = working_copy_rows(params)
    _free()
    for block, warps in dict.fromkeys(SWEEP):
        triton_opt = TritonAdamW(params, **KW, block=block, num_warps=warps)
        rows[f"Triton AdamW, fp32 weights + gradients, block {block}, {warps} warps"] = median(
            cuda_time_ms(triton_opt.step, warmup=3, iters=20)
        )
        if (block, warps) == (BLOCK, NUM_WARPS):
            rows["clipped step over fp32 gradients: norm + Triton AdamW, clip folded in"] = median(
                cuda_time_ms(lambda: clipped_step(triton_opt, [p.grad for p in params], 1.0), warmup=3, iters=20)
            )
        triton_opt = None
        _free()
    fused = torch.optim.AdamW(params, **KW, fused=True)
    rows["torch fused AdamW, per-tensor"] = median(cuda_time_ms(fused.step, warmup=3, iters=20))

    def torch_clipped_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        fused.step()

    saved = [p.grad.clone() for p in params]  # clip_grad_norm_ rewrites the gradients
    rows["clip_grad_norm_ + torch fused AdamW"] = median(cuda_time_ms(torch_clipped_step, warmup=3, iters=20))
    for p, g in zip(params, saved):
        p.grad.copy_(g)
    fused = saved = None
    _free()
    n = sum(p.numel() for p in params)
    flat = torch.nn.Parameter(torch.randn(n, device=params[0].device) * 0.02)
    flat.grad = torch.randn_like(flat) * 1e-3
    opt = torch.optim.AdamW([flat], **KW, fused=True)
    rows["torch fused AdamW, one flat tensor"] = median(cuda_time_ms(opt.step, warmup=3, iters=20))
    del opt, flat
    _free()
    if compiled:
        rows["torch.compile'd foreach AdamW (tensor lr), per-tensor"] = compiled_optimizer_ms(params)
    return rows


def compiled_optimizer_ms(params) -> float | None:
    """AdamW's step compiled by inductor (PyTorch's "compiled optimizer" recipe: the learning rate
    a tensor, so a schedule changes a value, not a guard), fresh state. None if it does not
    compile here."""
    try:
        kw = dict(KW, lr=torch.tensor(KW["lr"], device=params[0].device))
        opt = torch.optim.AdamW(params, **kw, foreach=True, capturable=True)  # a tensor lr needs capturable
        step = torch.compile(opt.step, dynamic=False)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(json.dumps({"compiled_optimizer_first_call_s": round(time.perf_counter() - t0, 1)}), flush=True)
        ms = median(cuda_time_ms(step, warmup=3, iters=20))
        del opt, step
        return ms
    except Exception:  # noqa: BLE001 - a row, not a crash
        traceback.print_exc()
        return None
    finally:
        _free()


def table_rows(rows: dict[str, float | None], n_params: int) -> list[dict]:
    # fp32 param r+w, grad r, exp_avg r+w, exp_avg_sq r+w; with a working copy the gradient read
    # is 2 bytes and the copy's write another 2 (the norms' few parameters aside)
    bytes_moved = 28 * n_params
    return [
        {"optimizer": name, "ms": round(ms, 2), "TB_per_s": round(bytes_moved / (ms * 1e-3) / 1e12, 2)}
        for name, ms in rows.items()
        if ms is not None
    ]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--compiled", action="store_true", help="also torch.compile the foreach step (slow cold compile)")
    args = p.parse_args(argv)
    with torch.device("cuda:0"):
        drafter = DFlashDrafter(reference_drafter_config(args.layers))
    params = list(drafter.parameters())
    for prm in params:
        prm.grad = torch.randn_like(prm) * 1e-3
    n = sum(prm.numel() for prm in params)
    table = table_rows(optimizer_rows(params, args.compiled), n)
    env = env_record()
    report(
        "optimizer",
        {"env": env, "params": n, "tensors": len(params), "rows": table},
        f"Optimizer step, {env['gpu']}, torch {env['torch']}, {n / 1e9:.3f}B fp32 parameters in {len(params)} "
        "tensors, 28 bytes moved per parameter",
        table,
        ["optimizer", "ms", "TB_per_s"],
    )


if __name__ == "__main__":
    main()
