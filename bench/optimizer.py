"""The optimizer step over the drafter's parameters at the reference widths (~1.05B fp32), on
one GPU, apart from the forward and backward (DESIGN.md section 7's optimizer row).

    python -m bench.optimizer [--layers 5] [--compiled]

Rows: the engine's Triton AdamW (block size / warps sweep; the default first), the engine's
clipped step (norm + AdamW with the clip folded in: what the training loop runs), torch's fused
AdamW per tensor and over one flat tensor, the engine's previous clip_grad_norm_ + fused step,
and (--compiled, ~45 s of cold compile) torch.compile of the foreach step. Medians of 20
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
from dflash_core.engine.adamw_triton import BLOCK, NUM_WARPS, TritonAdamW
from dflash_core.engine.optim import clipped_step

KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
SWEEP = [(BLOCK, NUM_WARPS), (2048, 8), (2048, 4), (4096, 8), (8192, 16)]


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def optimizer_rows(params, compiled: bool = False) -> dict[str, float | None]:
    """Milliseconds per optimizer step by implementation, over `params` (their .grad set)."""
    rows: dict[str, float | None] = {}
    for block, warps in dict.fromkeys(SWEEP):
        triton_opt = TritonAdamW(params, **KW, block=block, num_warps=warps)
        engine = (block, warps) == (BLOCK, NUM_WARPS)
        rows[f"Triton AdamW, block {block}, {warps} warps" + (" (engine)" if engine else "")] = median(
            cuda_time_ms(triton_opt.step, warmup=3, iters=20))
        if engine:
            rows["engine clipped step: norm + Triton AdamW, clip folded in"] = median(
                cuda_time_ms(lambda: clipped_step(triton_opt, params, 1.0), warmup=3, iters=20))
        triton_opt = None
        _free()
    fused = torch.optim.AdamW(params, **KW, fused=True)
    rows["torch fused AdamW, per-tensor"] = median(cuda_time_ms(fused.step, warmup=3, iters=20))

    def old_engine_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        fused.step()

    saved = [p.grad.clone() for p in params]  # clip_grad_norm_ rewrites the gradients
    rows["clip_grad_norm_ + torch fused AdamW (the engine before)"] = median(cuda_time_ms(old_engine_step, warmup=3, iters=20))
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
    bytes_moved = 28 * n_params  # param r+w, grad r, exp_avg r+w, exp_avg_sq r+w (fp32)
    return [{"optimizer": name, "ms": round(ms, 2), "TB_per_s": round(bytes_moved / (ms * 1e-3) / 1e12, 2)}
            for name, ms in rows.items() if ms is not None]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--compiled", action="store_true", help="also torch.compile the foreach step (~45 s cold)")
    args = p.parse_args(argv)
    with torch.device("cuda:0"):
        drafter = DFlashDrafter(reference_drafter_config(args.layers))
    params = list(drafter.parameters())
    for prm in params:
        prm.grad = torch.randn_like(prm) * 1e-3
    n = sum(prm.numel() for prm in params)
    table = table_rows(optimizer_rows(params, args.compiled), n)
    env = env_record()
    report("optimizer", {"env": env, "params": n, "tensors": len(params), "rows": table},
           f"Optimizer step, {env['gpu']}, torch {env['torch']}, {n / 1e9:.3f}B fp32 parameters in {len(params)} "
           "tensors, 28 bytes moved per parameter", table, ["optimizer", "ms", "TB_per_s"])


if __name__ == "__main__":
    main()
