"""Drafter training step at the reference shape (docs/design.md) on one GPU.

    python -m bench.drafter_step [--layers 5] [--variants flex_layer,flex_layer_fp8,flex_layer_q4,flex,sdpa_dense,sdpa_chunked,flex_eager,flex_step,reference,reference_mask_once]
                                 [--warm-jobs 4]   # a cold machine: compile the variants in parallel first
                                 [--reference-src PATH]  # a clone of github.com/z-lab/dflash, for `reference`

Times forward+backward (median of CUDA-event timings after warmup) through the engine's own
replica code path, counts model FLOPs from the mask, reports MFU against a bf16 matmul measured
in the same run, peak/steady reserved memory; times the optimizer step on its own; then runs 100
full steps (fwd+bwd+optimizer) of the first variant and reports memory flatness. Writes
$OUT/drafter_step.json and prints a table last. The `reference` variant is the public reference's
step on the same micro-batch (bench.reference_step says what it runs); with it in the run, every
row also gets its time as a fraction of the reference's.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from dataclasses import replace

import torch

from bench.common import (
    REFERENCE_SHAPE,
    add_warm_arguments,
    cuda_time_ms,
    drafter_flops,
    env_record,
    measured_bf16_peak_tflops,
    out_dir,
    pid_alive,
    print_table,
    reference_drafter_config,
    timing_fields,
    warm_caches_in_parallel,
)
from bench.optimizer import compiled_optimizer_ms, optimizer_rows, table_rows
from bench.variants import variant_kernels
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.drafter import FrozenHead
from dflash_core.engine.config import StepPlan
from dflash_core.engine.replica import DrafterReplica, ReplicaStep
from dflash_core.step.attention import dense_mask, dflash_mask_mod

ENGINE = StepPlan(attention="flex", compiled=True, loss="triton", working_weights="bf16")  # step_plan on CUDA
FP32W = replace(ENGINE, working_weights="fp32")
FP8 = replace(ENGINE, precision="fp8", loss="triton_fp8")  # step_plan with [engine] precision = "fp8"
EAGER_SDPA = StepPlan(attention="dense", compiled=False, loss="triton", working_weights="bf16")  # our SDPA path
# variant -> (plan, compile scope, query splits); bench.variants says what each means
VARIANTS = {
    "flex_layer": (ENGINE, "layer", 1),  # the engine's step
    "flex_layer_fp8": (FP8, "layer", 1),  # FP8 GEMMs: the drafter's linears and the lm_head in the loss
    "flex_layer_fp8_linears": (replace(FP8, loss="triton"), "layer", 1),  # the linears alone in FP8
    "flex_layer_fp8_head": (replace(ENGINE, loss="triton_fp8"), "layer", 1),  # the lm_head alone in FP8
    "flex_layer_fp32w": (FP32W, "layer", 1),  # fp32 working weights: autocast casts every matrix, every step
    "flex_layer_inductor_ce": (replace(FP32W, loss="compiled"), "layer", 1),  # and the inductor-compiled loss chunks
    "flex_layer_q4": (ENGINE, "layer", 4),
    "flex_layer_q8": (ENGINE, "layer", 8),
    "flex_step": (ENGINE, "step", 1),
    "flex": (ENGINE, "attention", 1),
    "sdpa_dense": (EAGER_SDPA, "layer", 1),
    "sdpa_chunked": (replace(EAGER_SDPA, attention="dense_chunked"), "layer", 1),
    "flex_eager": (replace(EAGER_SDPA, attention="flex"), "layer", 1),
}

# the public reference's step (bench.reference_step): its mask built every step, or once
REFERENCE_VARIANTS = ("reference", "reference_mask_once")


def make_replica(cfg, head, variant, chunk):
    plan, scope, q_splits = VARIANTS[variant]
    rep = DrafterReplica(0, cfg, "cuda:0", head, plan, ReplicaStep(7.0, chunk))
    rep.kernels = variant_kernels(rep.drafter, plan, scope, q_splits)
    rep.init_weights(0)
    return rep


def fwd_bwd_of(rep, batch, feats):
    """One forward + backward of the replica, from zero gradients."""

    def fwd_bwd():
        rep.zero_grad()
        rep.forward_backward(batch, feats, 1.0, rep.new_accumulator())

    return fwd_bwd


def bench_variant(name, cfg, head, batch, feats, iters, chunk):
    rep = make_replica(cfg, head, name, chunk)
    fwd_bwd = fwd_bwd_of(rep, batch, feats)
    t0 = time.perf_counter()
    fwd_bwd()  # compile (if any) before the clocks
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = cuda_time_ms(fwd_bwd, warmup=2, iters=iters)
    res = {"variant": name, **timing_fields(times), "first_call_s": round(first_call_s, 1)}
    return rep, res


KERNEL_CLASSES = (  # first match wins; names as the CUDA profiler reports them
    ("flex attention", ("flex_attention", "triton_tem_fused")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul", "splitk")),
    ("lm_head + CE (fused)", ("logsumexp", "argmax", "_ce_rows_kernel")),
    ("distillation kernel", ("_distill_rows_kernel", "_row_lse_kernel")),
    ("gather", ("index_select", "indexselect", "gather")),
    ("fused triton", ("triton_",)),  # before "copy": inductor names its kernels after the ops fused (_to_copy)
    ("eager copy / cast", ("copy", "cat", "fill", "memset")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other eager"


def profile(rep, batch, feats, name, steps=3, table=False):
    """Device time per kernel class (ms per step); the top kernels when `table`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fwd_bwd = fwd_bwd_of(rep, batch, feats)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd_bwd()
        torch.cuda.synchronize()
    classes: dict[str, float] = {}
    for ev in prof.key_averages():
        # self time: a kernel's time counts once, not again under the op that launched it
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us:
            label = kernel_class(ev.key)
            classes[label] = classes.get(label, 0.0) + us / 1000 / steps
    classes = {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])}
    print(json.dumps({"profile": name, "ms_per_step_by_class": classes}), flush=True)
    if table:
        sort = "device_time_total" if hasattr(prof.key_averages()[0], "device_time_total") else "cuda_time_total"
        text = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=90)
        (out_dir() / f"profile_{name}.txt").write_text(text)
        print(text)
    return classes


def bench_optimizer(rep, compiled: bool):
    """The optimizer rows of bench.optimizer over this replica's parameters; the engine's step
    (its optimizer alone, without the norm) is the headline number."""
    for m in rep.masters:  # fp32: optimizer_rows makes the bf16 working copies itself
        m.grad = torch.randn_like(m) * 1e-3
    n = sum(m.numel() for m in rep.masters)
    rows = optimizer_rows(rep.masters, compiled)
    for row in table_rows(rows, n):
        print(json.dumps(row), flush=True)
    engine = next(ms for name, ms in rows.items() if name.endswith("(engine)"))
    return round(engine, 2), n, {k: (round(v, 2) if v is not None else None) for k, v in rows.items()}


def flatness(rep, batch, feats, steps=100):
    rep.zero_grad()  # the optimizer bench's fp32 gradients on the masters
    rep.optimizer = rep.optimizer or rep.new_optimizer(1e-4, 0.0, (0.9, 0.95))

    def step():
        acc = rep.new_accumulator()
        rep.forward_backward(batch, feats, 1.0, acc)
        rep.clip_and_step(1.0, 1e-4)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    reserved = []
    for _ in range(steps):
        step()
        reserved.append(torch.cuda.memory_reserved())
    torch.cuda.synchronize()
    s1 = torch.cuda.memory_stats()
    return {
        "steps": steps,
        "reserved_min_gib": round(min(reserved) / 2**30, 3),
        "reserved_max_gib": round(max(reserved) / 2**30, 3),
        "reserved_swing_pct": round(100 * (max(reserved) - min(reserved)) / max(reserved), 3),
        "alloc_retries": s1.get("num_alloc_retries", 0) - s0.get("num_alloc_retries", 0),
        "device_allocs": s1.get("num_device_alloc", 0) - s0.get("num_device_alloc", 0),
    }


def reference_inputs(cfg):
    """The frozen head, micro-batch and target features every variant runs on (seeded)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
    )
    batch = synthetic_micro_batch(REFERENCE_SHAPE, cfg.vocab_size, 0).to("cuda")
    feats = torch.randn(
        REFERENCE_SHAPE.seq_len,
        cfg.num_target_features * cfg.hidden_size,
        device="cuda",
        dtype=torch.bfloat16,
        generator=g,
    )
    return head, batch, feats


def compile_variant(name, layers, chunk, first_variant):
    """A warm-up child: compile one variant, or ("optimizer", with --compiled-optimizer) the
    compiled AdamW step over the first variant's parameters, to fill the inductor and Triton
    caches; then exit."""
    cfg = reference_drafter_config(layers)
    head, batch, feats = reference_inputs(cfg)
    t0 = time.perf_counter()
    if name == "optimizer":
        rep = make_replica(cfg, head, first_variant, chunk)
        for m in rep.masters:
            m.grad = torch.randn_like(m) * 1e-3
        compiled_optimizer_ms(rep.masters)
    else:
        rep = make_replica(cfg, head, name, chunk)
        fwd_bwd_of(rep, batch, feats)()
    torch.cuda.synchronize()
    print(f"[{name}] compiled and run in {time.perf_counter() - t0:.1f}s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--variants", default="flex_layer,sdpa_dense,sdpa_chunked")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--flat-steps", type=int, default=100)
    p.add_argument("--chunk", type=int, default=2048, help="query tokens per lm_head+CE chunk")
    p.add_argument(
        "--profile", action="store_true", help="device time by kernel class per variant; top kernels of the first"
    )
    add_warm_arguments(p, "variants")
    p.add_argument(
        "--compiled-optimizer",
        action="store_true",
        help="also time torch.compile's AdamW step (a cold compile of tens of seconds)",
    )
    p.add_argument("--reference-src", help="z-lab/dflash checkout (or its dflash/model.py) for the reference variant")
    p.add_argument("--wait-pid", type=int, default=0, help="time nothing until this process has exited")
    p.add_argument("--cases", help=argparse.SUPPRESS)  # one variant, with --compile-only (a warm-up child)
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS and n not in REFERENCE_VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    ours = [n for n in names if n in VARIANTS]  # the first of them also times the optimizer
    if args.compile_only:
        return compile_variant(args.cases, args.layers, args.chunk, ours[0] if ours else "flex_layer")
    if set(names) & set(REFERENCE_VARIANTS) and not args.reference_src:
        p.error("the reference variants need --reference-src")
    warm = {}
    if args.warm_jobs:
        compiled = [n for n in names if n in VARIANTS and VARIANTS[n][0].compiled] + (
            ["optimizer"] if args.compiled_optimizer else []
        )
        warm = warm_caches_in_parallel(
            "bench.drafter_step",
            compiled,
            ["--layers", str(args.layers), "--chunk", str(args.chunk), "--variants", args.variants],
            args.warm_jobs,
            args.warm_budget,
        )
    while args.wait_pid and pid_alive(args.wait_pid):
        time.sleep(1)
    env = env_record()
    peak = measured_bf16_peak_tflops()
    shape = REFERENCE_SHAPE
    cfg = reference_drafter_config(args.layers)
    head, batch, feats = reference_inputs(cfg)
    mod = dflash_mask_mod(batch.doc_ids, batch.anchors, batch.anchor_valid, shape.seq_len, shape.block_size)
    visible = int(dense_mask(mod, shape.num_query_tokens, shape.kv_len, "cuda").sum())
    flops = drafter_flops(cfg, shape, visible)
    rows, opt_ms, n_params, opt_rows, flat = [], None, None, None, None
    for name in names:
        if warm.get(name) == "killed":  # compiling it cold here would overrun the call
            rows.append({"variant": name, "error": f"not compiled within --warm-budget {args.warm_budget:.0f}s"})
            continue
        # one replica on the GPU at a time: each row's memory is its own; the first variant's
        # replica also times the optimizer and the flatness run before it is dropped
        rep = None
        try:
            if name in REFERENCE_VARIANTS:
                from bench.reference_step import bench_reference

                res = bench_reference(args.reference_src, cfg, head, batch, feats, args.iters, name)
            else:
                rep, res = bench_variant(
                    name, cfg, head, batch, feats, args.iters if "eager" not in name else 5, args.chunk
                )
            res["tflops"] = round(flops["total"] / (res["median_ms"] * 1e-3) / 1e12, 1)
            res["mfu_pct"] = round(100 * res["tflops"] / peak, 1)
            if rep is not None and args.profile and "eager" not in name:
                res["profile_ms"] = profile(rep, batch, feats, name, table=name == ours[0])
            if rep is not None and name == ours[0]:
                rep.zero_grad()
                opt_ms, n_params, opt_rows = bench_optimizer(
                    rep, compiled=args.compiled_optimizer and warm.get("optimizer") != "killed"
                )
                rep.zero_grad()
                print(json.dumps({"optimizer_ms": opt_ms}), flush=True)
                flat = flatness(rep, batch, feats, args.flat_steps)
                print(json.dumps({"flatness": flat}), flush=True)
        except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
            traceback.print_exc()
            res = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        finally:
            del rep  # one replica on the GPU at a time
        rows.append(res)
        print(json.dumps(res), flush=True)
        (out_dir() / "drafter_step_rows.json").write_text(json.dumps(rows, indent=1))  # survives a timeout
        gc.collect()
        torch.cuda.empty_cache()
    first_ms = rows[0].get("median_ms")
    ref_ms = next((r.get("median_ms") for r in rows if r["variant"] == "reference"), None)
    for r in rows:
        if r.get("median_ms") and first_ms:
            r["speedup_of_first"] = round(r["median_ms"] / first_ms, 2)
        if r.get("median_ms") and ref_ms:
            r["of_reference"] = round(r["median_ms"] / ref_ms, 2)
    record = {
        "env": env,
        "peak_bf16_tflops": round(peak, 1),
        "shape": vars(shape),
        "layers": args.layers,
        "loss_chunk": args.chunk,
        "visible_pairs": visible,
        "flops": flops,
        "rows": rows,
        "optimizer_ms": opt_ms,
        "optimizer_variants_ms": opt_rows,
        "optimizer_params": n_params,
        "flatness": flat,
    }
    (out_dir() / "drafter_step.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}, indent=1))
    print(
        f"\nDrafter step, {env['gpu']}, torch {env['torch']}, S={shape.seq_len} N={shape.num_anchors} B={shape.block_size}, "
        f"{args.layers} layers, {flops['total'] / 1e12:.1f} TFLOP/step, peak {peak:.0f} TFLOP/s, optimizer {opt_ms} ms"
    )
    print_table(
        rows,
        [
            "variant",
            "median_ms",
            "min_ms",
            "first_call_s",
            "tflops",
            "mfu_pct",
            "peak_reserved_gib",
            "steady_reserved_gib",
            "speedup_of_first",
            "of_reference",
            "error",
        ],
    )


if __name__ == "__main__":
    main()
