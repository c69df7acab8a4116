"""The decode-attention kernel alone (kernels/decode_attention.py) against the copy bandwidth, over
its launch settings, at the regeneration bench's shape (Qwen3-8B's heads: 32 query, 8 key-value,
head dim 128), and where a decode step's time goes.

Sweep rows, one per setting (block_n, num_warps, num_stages, splits), each slot's whole cache
valid (the step at the cache's end, what `of_bound` in bench.regenerate times):

  ms          median of the kernel (and the split combine, with splits > 1), launches queued back
              to back (triton.testing.do_bench, the L2 flushed between them): device time, as a
              recorded decode step runs it, not the Python launch
  gb_s        the key and value bytes it must read / ms
  of_copy     gb_s against a device-to-device copy's bytes (read + write) per second

Then the decode step itself (the regeneration decoder, eager, the attention as the kernel with
the default settings) under torch.profiler at the same slot count: device time per kernel class
(GEMM, attention, other), the share of each, and each class's floor (`floor_ms`: the GEMMs' FLOPs
at the bf16 matmul rate measured in the run, the attention's key and value bytes at the copy
bandwidth, nothing for the rest), so that what is left over the bound has a name.

    python -m bench.decode_attention [--slots 512] [--length 1024] [--profile-step]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.testing

import dflash_core.kernels.decode_attention as dak
from bench.common import QWEN3_8B, env_record, measured_bf16_peak_tflops, report, write_target_dir
from bench.regenerate import copy_bandwidth, prefill_weights
from dflash_core.kernels.decode_attention import decode_attention, split_count


def sweep(slots: int, length: int, bandwidth: float, blocks, warps, stages, splits) -> list[dict]:
    hq, hkv, d = 32, 8, 128
    q = torch.randn(slots, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(slots, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ranges = torch.tensor([[0, length]] * slots, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * k.numel() * k.element_size()
    default_splits = split_count(slots, hkv, length, q.device)
    ref = decode_attention(q, k, v, ranges, d**-0.5)
    rows = []
    for bn, nw, ns, sp in itertools.product(blocks, warps, stages, splits):
        fn = lambda: decode_attention(q, k, v, ranges, d**-0.5, splits=sp, block_n=bn, num_warps=nw, num_stages=ns)  # noqa: E731
        try:
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a setting that does not fit (shared memory) is a row too
            rows.append({"block_n": bn, "warps": nw, "stages": ns, "splits": sp, "error": type(e).__name__})
            continue
        gb_s = kv_bytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "block_n": bn,
                "warps": nw,
                "stages": ns,
                "splits": sp,
                "ms": round(ms, 4),
                "gb_s": round(gb_s),
                "of_copy": round(gb_s * 1e9 / bandwidth, 3),
                "max_err": float(f"{err:.2g}"),
                "default": (sp, bn, nw, ns) == (default_splits, dak.BLOCK_N, dak.NUM_WARPS, dak.NUM_STAGES),
            }
        )
        print(rows[-1], flush=True)
    return rows


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("_split_kernel", "_combine_kernel", "flash", "fmha", "attention")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "sm90", "nvjet", "cublas", "matmul", "fp8_gemm", "scaled_mm")):
        return "gemm"
    return "other"


def by_class(prof, steps: int, floors: dict[str, float]) -> list[dict]:
    """Device time of the profiled kernels per class, per step, beside each class's floor (ms);
    the top kernels printed."""
    per_class: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    calls: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
        per_class[kernel_class(evt.name)] = per_class.get(kernel_class(evt.name), 0.0) + us
        per_kernel[evt.name] = per_kernel.get(evt.name, 0.0) + us
        calls[evt.name] = calls.get(evt.name, 0) + 1
    total = sum(per_class.values())
    rows = [
        {
            "class": c,
            "ms_per_step": round(us / steps / 1e3, 3),
            "share": round(us / total, 3),
            "floor_ms": round(floors.get(c, 0.0), 3),
        }
        for c, us in sorted(per_class.items(), key=lambda kv: -kv[1])
    ]
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]:
        n = calls[name] // steps
        print(f"  {us / steps / 1e3:8.3f} ms/step {n:5d} calls  {kernel_class(name):9s} {name[:100]}", flush=True)
    return rows


@torch.no_grad()
def profile_step(slots: int, prompt_len: int, new_tokens: int, bandwidth: float) -> tuple[list[dict], list[dict]]:
    """The decode step (eager, near the cache's end) and one prefill chunk (as the decoder cuts
    them: its token budget of prompts of prompt_len), each by kernel class."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder
    from dflash_core.regenerate.sizing import kv_bytes_per_token
    from dflash_core.target import TargetModel

    target_dir = write_target_dir(Path(tempfile.mkdtemp()) / "target", QWEN3_8B)
    target = TargetModel(target_dir, [1], "cuda:0", random_init=True)
    length = prompt_len + new_tokens
    dec = SlotDecoder(target.model, slots, length, use_graph=False, attention_kernel=True)
    greedy = Sampling(ignore_stop=True)
    list(dec.generate([Request(-1, list(range(10, 10 + prompt_len)), 4)], greedy))
    dec.positions.fill_(length - 8)
    for _ in range(3):
        dec._replay("greedy")
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec._replay("greedy")
        torch.cuda.synchronize()
    peak = measured_bf16_peak_tflops() * 1e12
    head = target.model.get_output_embeddings().weight.numel()
    layers = prefill_weights(target.model)
    kv = kv_bytes_per_token(target.model.config, dec.dtype) * (length - 8)
    decode = by_class(
        prof, steps, {"gemm": 2 * slots * (layers + head) / peak * 1e3, "attention": slots * kv / bandwidth * 1e3}
    )
    chunk = [(i, Request(i, list(range(10, 10 + prompt_len)), 1)) for i in range(dec.prefill_tokens // prompt_len)]
    dec._prefill(chunk, "greedy")
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec._prefill(chunk, "greedy")
        torch.cuda.synchronize()
    print(f"prefill of {len(chunk)} x {prompt_len} tokens: {time.perf_counter() - t:.3f} s wall (profiled)", flush=True)
    tokens = len(chunk) * prompt_len
    return decode, by_class(prof, 1, {"gemm": 2 * tokens * layers / peak * 1e3})


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--splits", default="1,2")
    p.add_argument("--profile-step", action="store_true", help="also profile a decode step (needs a target's memory)")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = sweep(
        args.slots, args.length, bandwidth, ints(args.block_n), ints(args.warps), ints(args.stages), ints(args.splits)
    )
    cols = ["block_n", "warps", "stages", "splits", "ms", "gb_s", "of_copy", "max_err", "default"]
    record = {"env": env_record(), "slots": args.slots, "length": args.length, "copy_gb_s": round(bandwidth / 1e9)}
    report("decode_attention", {**record, "rows": rows}, "decode attention kernel sweep", rows, cols)
    if args.profile_step:
        torch.cuda.empty_cache()
        step, prefill = profile_step(args.slots, args.length // 2, args.length // 2, bandwidth)
        report("decode_step_profile", {**record, "rows": step}, "decode step by kernel class", step, list(step[0]))
        report(
            "prefill_profile",
            {**record, "rows": prefill},
            "one prefill chunk by kernel class",
            prefill,
            list(prefill[0]),
        )


if __name__ == "__main__":
    main()
