"""The target's capture per micro-batch: eager forward against its CUDA graph replay.

    python -m bench.target_capture [--seq-len 3072] [--iters 30]
                                   [--precisions bf16,bf16_fused,bf16_fused_sdpa,fp8,fp8_fused,...] [--eager] [--profile]

A Qwen3-8B-shaped target with random weights on cuda:0 captures 5 layers' outputs of packed
synthetic micro-batches (what the feature pipeline's thread does per micro-batch), as the engine
runs it: its CUDA graph replayed. For each precision (bf16; fp8 = target_precision "fp8";
fp8_torch_casts = the same with the activation casts as torch ops, the way before the Triton
cast; a `_fused` suffix: the graph records the compiled decoder layers, as the engine records
it, else the eager layers; `_fused_sdpa`: the compiled layers with SDPA under the whole mask in
place of the packed flex attention): host_ms, the time the calling thread spends issuing the work (what holds the GIL), and
total_ms, until the device finished; medians after warm-up. The graph's outputs are compared bit
for bit with the forward it recorded run without the graph, and each row's features with the
first row's (the same seed gives the same weights). --profile adds device time by kernel class
of the recorded forward; record_s includes the fused layers' compile, from an empty inductor cache
of the run's own (a temporary directory, removed at the end; an exported TORCHINDUCTOR_CACHE_DIR
is used instead), so two trees run one after the other do not share kernels; the rows of one run
do.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from bench.common import QWEN3_8B, REFERENCE_SHAPE, env_record, out_dir, report, write_target_dir
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.engine.compile import use_cache_dir
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


class TorchOpCasts:
    """The FP8 target's activation casts as torch ops, once per linear (no sharing): how the
    target cast before kernels/fp8_cast.py, for the side-by-side row."""

    def cast(self, x, cols):
        import torch.nn.functional as F

        from dflash_core.fp8 import FORWARD_DTYPE, FP8_MULTIPLE, quantize

        x2 = x.reshape(-1, cols)
        rows = x2.shape[0]
        x8, inv = quantize(F.pad(x2, (0, 0, 0, -rows % FP8_MULTIPLE)), FORWARD_DTYPE)
        return x8, inv, rows

    def clear(self):
        pass


def build_target(out, precision: str) -> TargetModel:
    """bf16, fp8 (target_precision = "fp8" as the engine builds it) or fp8_torch_casts (a
    `_fused` suffix is record_graph's)."""
    precision = precision.removesuffix("_sdpa").removesuffix("_fused")
    target = TargetModel(out / "target", [1, 9, 17, 25, 33], "cuda:0", random_init=True, fp8=precision != "bf16")
    if precision == "fp8_torch_casts":
        from dflash_core.target_precision import Fp8FrozenLinear

        casts = TorchOpCasts()
        for m in target.decoder_layers().modules():
            if isinstance(m, Fp8FrozenLinear):
                m.casts = casts
        target._input_casts = casts
    return target


KERNEL_CLASSES = (  # first match wins; kernel names as the CUDA profiler reports them
    ("fp8 cast (Triton)", ("_amax_kernel", "_cast_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "flex", "triton_tem")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul")),
)


def profile_classes(fn, args) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Device ms per capture by kernel class, and the ten costliest kernels (an eager capture:
    the graph replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
    classes: dict[str, float] = {}
    kernels: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0)
        if not us:
            continue
        low = ev.key.lower()
        label = next((name for name, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")
        classes[label] = classes.get(label, 0.0) + us / 1000 / 3
        kernels.append((ev.key[:90], round(us / 1000 / 3, 2)))
    top = sorted(kernels, key=lambda kv: -kv[1])[:10]
    return {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])}, top


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=REFERENCE_SHAPE.seq_len)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--precisions", default="bf16", help="comma-separated: bf16, fp8, fp8_torch_casts, each also with _fused"
    )
    p.add_argument("--eager", action="store_true", help="also time the eager capture of each")
    p.add_argument("--profile", action="store_true", help="device time by kernel class of each")
    args = p.parse_args(argv)
    out = out_dir()
    cache = tempfile.mkdtemp(prefix="target-capture-inductor-")
    try:
        use_cache_dir(cache, "this run's own, for record_s")
        run(args, out)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run(args: argparse.Namespace, out) -> None:
    write_target_dir(out / "target", QWEN3_8B)
    shape = ShapeConfig(seq_len=args.seq_len, num_anchors=REFERENCE_SHAPE.num_anchors, block_size=16)
    batches = []
    for seed in range(4):
        mb = synthetic_micro_batch(shape, QWEN3_8B["vocab_size"], 0, seed=seed)
        batches.append(tuple(t.to("cuda:0") for t in (mb.input_ids, mb.position_ids, mb.doc_ids)))
    rows, reference = [], None
    for precision in args.precisions.split(","):
        target = build_target(out, precision)
        row = {"precision": precision}
        if args.eager:
            row["eager_host_ms"], row["eager_total_ms"] = (
                round(v, 2) for v in time_capture(target._capture, batches, args.iters)
            )
        t = time.perf_counter()
        fuse, sdpa = "_fused" in precision, precision.endswith("_sdpa")
        assert target.record_graph(args.seq_len, fuse=fuse, packed_attention=not sdpa)
        row["record_s"] = round(time.perf_counter() - t, 2)
        if args.profile:
            row["profile_ms"], top = profile_classes(target.capture_ungraphed, batches[0])
            print(precision, "top kernels (ms per capture):", *top, sep="\n  ", flush=True)
        if target.fused:  # one fused layer against the eager layer on the same input
            row["layer_rel_err"] = float(f"{target.fused_layer_error(*batches[0]):.2e}")
        row["graph_equals_ungraphed"] = all(
            torch.equal(target.capture(*b).clone(), target.capture_ungraphed(*b)) for b in batches
        )
        host, total = time_capture(target.capture, batches, args.iters)
        row["host_ms"], row["total_ms"] = round(host, 2), round(total, 2)
        feats = target.capture(*batches[0]).float()
        if reference is None:
            reference = feats.clone()
        row["features_rel_err"] = round(float((feats - reference).norm() / reference.norm()), 4)
        row["reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
        rows.append(row)
        print(row, flush=True)
        del target, feats
        torch.cuda.empty_cache()
    base = rows[0]["total_ms"]
    for row in rows:
        row["of_first"] = round(row["total_ms"] / base, 2)
    report(
        "target_capture",
        {"env": env_record(), "seq_len": args.seq_len, "rows": rows},
        f"target capture per micro-batch (CUDA graph replay), Qwen3-8B shape, S={args.seq_len}",
        rows,
        [
            "precision",
            "total_ms",
            "host_ms",
            "of_first",
            "record_s",
            "graph_equals_ungraphed",
            "features_rel_err",
            "layer_rel_err",
            "eager_total_ms",
            "reserved_gib",
        ],
    )


if __name__ == "__main__":
    main()
