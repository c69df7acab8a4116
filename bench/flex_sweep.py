"""flex_attention alone at the reference shape: where does its backward time go?

    python -m bench.flex_sweep [--anchors 512] [--cases all|NAME,NAME...] [--warm-jobs 8]

Times flex forward and forward+backward on its own (q [1, 32, Q, 128], k/v [1, 8, KV, 128],
bf16, a random output gradient), one case per row:

  * the mask function: the production `dflash_mask_mod` (per-block context intervals: two loads
    per query row, none per key) against the element-wise form it replaced (`gather_mask_mod`:
    doc[kv] == doc[anchor], a gather per element, which makes every backward tile much slower);
  * query splits (FlexAttention.q_splits);
  * kernel block sizes / warps / stages of the backward (`kernel_options`);
  * the kernel itself: the same sizes with no mask at all ("dense") as a control.

Each row: forward ms, backward ms (fwd+bwd minus fwd), tiles the BlockMask computes (partial,
full), TFLOP/s on the computed tiles, and the largest difference from the production output.
Writes $OUT/flex_sweep.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from bench.common import (
    add_shape_arguments,
    add_warm_arguments,
    cuda_time_ms,
    env_record,
    median,
    out_dir,
    pid_alive,
    print_table,
    warm_caches_in_parallel,
)
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import MicroBatch, synthetic_micro_batch
from dflash_core.step.attention import build_block_mask, dflash_mask_mod

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

BWD_SMALL = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
BWD_LARGE = {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64}
CASES = {  # name: (mask, q_splits, kernel_options); "dflash" first: the others are compared to it
    "dflash": ("dflash", 1, None),
    "dflash_q4": ("dflash", 4, None),
    "gather": ("gather", 1, None),
    "gather_q4": ("gather", 4, None),
    "dflash_bwd_small": ("dflash", 1, BWD_SMALL),
    "dflash_bwd_large": ("dflash", 1, BWD_LARGE),
    "dflash_warps8": ("dflash", 1, {"num_warps": 8}),
    "dflash_stages3": ("dflash", 1, {"num_stages": 3}),
    "dflash_n1_64": ("dflash", 1, {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 128, "BLOCK_N2": 64}),
    "dflash_tma": ("dflash", 1, {"USE_TMA": True}),
    "dense": ("none", 1, None),
}


def gather_mask_mod(doc_ids, anchors, anchor_valid, seq_len: int, block_size: int, queries_per_batch: int = 0):
    """The element-wise form of the DFlash mask, kept as the baseline the interval form is timed
    against: the same function (tests/test_bench_masks.py), with a document-id gather per
    (query, key) element."""
    num_anchors = anchors.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        if queries_per_batch:
            q_idx = b * queries_per_batch + q_idx
        block = torch.clamp(q_idx // block_size, max=num_anchors - 1)
        anchor = anchors[block]
        in_context = kv_idx < seq_len
        ctx_pos = torch.clamp(kv_idx, max=seq_len - 1)
        sees_context = in_context & anchor_valid[block] & (kv_idx < anchor) & (doc_ids[ctx_pos] == doc_ids[anchor])
        own_block = (~in_context) & ((kv_idx - seq_len) // block_size == block)
        return sees_context | own_block

    return mask_mod


def make_mask(kind: str, batch: MicroBatch, shape: ShapeConfig, splits: int):
    q_len, kv_len = shape.num_query_tokens, shape.kv_len
    per = q_len // splits
    if kind == "none":
        return None
    make = dflash_mask_mod if kind == "dflash" else gather_mask_mod
    mod = make(
        batch.doc_ids, batch.anchors, batch.anchor_valid, shape.seq_len, shape.block_size, per if splits > 1 else 0
    )
    return build_block_mask(mod, per, kv_len, "cuda", compiled=True, batches=splits)


def tile_counts(block_mask) -> tuple[int, int]:
    if block_mask is None:
        return 0, 0
    partial = int(block_mask.kv_num_blocks.sum())
    full = int(block_mask.full_kv_num_blocks.sum()) if block_mask.full_kv_num_blocks is not None else 0
    return partial, full


def run_case(name, shape, batch, q, k, v, grad_out, reference, compile_only=False):
    from torch.nn.attention.flex_attention import flex_attention

    kind, splits, options = CASES[name]
    # a fresh dynamo per case: every case compiles a no-grad and a grad graph, and past dynamo's
    # recompile limit flex would silently run uncompiled (materializing scores) instead
    torch._dynamo.reset()
    fn = torch.compile(flex_attention, dynamic=False)
    block_mask = make_mask(kind, batch, shape, splits)
    q_len = q.shape[2]

    def split(x):
        return x if splits == 1 else x.transpose(1, 2).reshape(splits, q_len // splits, HEADS, HEAD_DIM).transpose(1, 2)

    def join(x):
        return x if splits == 1 else x.transpose(1, 2).reshape(1, q_len, HEADS, HEAD_DIM).transpose(1, 2)

    kw = dict(block_mask=block_mask, enable_gqa=True)
    if options:
        kw["kernel_options"] = options

    def fwd():
        with torch.no_grad():
            return join(fn(split(q), k, v, **kw))

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        join(fn(split(q), k, v, **kw)).backward(grad_out)

    t0 = time.perf_counter()
    out = fwd()
    fwd_bwd()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    print(f"[{name}] forward and backward compiled and run in {compile_s:.1f}s", flush=True)
    if compile_only:
        return {"case": name, "compile_s": round(compile_s, 1)}, out
    fwd_ms = median(cuda_time_ms(fwd, warmup=3, iters=20))
    both_ms = median(cuda_time_ms(fwd_bwd, warmup=3, iters=20))
    partial, full = tile_counts(block_mask)
    tiles = partial + full if block_mask is not None else (q_len // 128) * (k.shape[2] // 128)
    flop_fwd = 4 * HEADS * HEAD_DIM * tiles * 128 * 128  # computed tiles, every query head
    row = {
        "case": name,
        "fwd_ms": round(fwd_ms, 3),
        "bwd_ms": round(both_ms - fwd_ms, 3),
        "bwd_over_fwd": round((both_ms - fwd_ms) / fwd_ms, 2),
        "partial_tiles": partial,
        "full_tiles": full,
        "fwd_tflops": round(flop_fwd / (fwd_ms * 1e-3) / 1e12, 1),
        "bwd_tflops": round(2.5 * flop_fwd / ((both_ms - fwd_ms) * 1e-3) / 1e12, 1),
        "compile_s": round(compile_s, 1),
    }
    if reference is not None and kind != "none":
        row["max_abs_diff"] = f"{(out.float() - reference.float()).abs().max().item():.2e}"
    return row, out


def main(argv=None):
    p = argparse.ArgumentParser()
    add_shape_arguments(p)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--cases", default="all")
    add_warm_arguments(p, "cases")
    p.add_argument("--wait-pid", type=int, default=0, help="time nothing until this process has exited")
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):  # an error, never a silent eager fallback
        dynamo_config.fail_on_recompile_limit_hit = True
    shape = ShapeConfig(seq_len=args.seq_len, num_anchors=args.anchors, block_size=args.block)
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    warm = {}
    if args.warm_jobs:
        shape_args = ["--seq-len", str(args.seq_len), "--anchors", str(args.anchors), "--block", str(args.block)]
        warm = warm_caches_in_parallel("bench.flex_sweep", names, shape_args, args.warm_jobs, args.warm_budget)
    while args.wait_pid and pid_alive(args.wait_pid):
        time.sleep(1)
    g = torch.Generator(device="cuda").manual_seed(0)
    batch = synthetic_micro_batch(shape, 151936, 0).to("cuda")
    q_len, kv_len = shape.num_query_tokens, shape.kv_len
    q = torch.randn(1, HEADS, q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad_out = torch.randn(1, HEADS, q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    rows, reference, env = [], None, env_record()
    for name in names:
        if warm.get(name) == "killed":  # compiling it cold here would overrun the call
            rows.append({"case": name, "error": f"not compiled within --warm-budget {args.warm_budget:.0f}s"})
            continue
        try:
            row, out = run_case(name, shape, batch, q, k, v, grad_out, reference, args.compile_only)
            if name == "dflash":
                reference = out
        except Exception as e:  # noqa: BLE001 - an unsupported option set is a row, not a crash
            traceback.print_exc()
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.compile_only:
            continue
        (out_dir() / "flex_sweep.json").write_text(
            json.dumps({"env": env, "shape": vars(shape), "rows": rows}, indent=1)
        )
    if args.compile_only:
        return
    print(
        f"\nflex_attention alone, S={shape.seq_len} N={shape.num_anchors} B={shape.block_size}, Q={q_len} KV={kv_len}, "
        f"{HEADS}/{KV_HEADS} heads x {HEAD_DIM}, bf16"
    )
    print_table(
        rows,
        [
            "case",
            "fwd_ms",
            "bwd_ms",
            "bwd_over_fwd",
            "fwd_tflops",
            "bwd_tflops",
            "partial_tiles",
            "full_tiles",
            "compile_s",
            "max_abs_diff",
            "error",
        ],
    )


if __name__ == "__main__":
    main()
