"""The regeneration decode step's GEMMs alone, at their row counts (one row per slot), against the
bf16 matmul rate: which shapes run below it, and whether an autotuned Triton GEMM does better.

Qwen3-8B's widths (bench.common.QWEN3_8B): the stacked q/k/v projection, o, gate (up is the same
shape), down and the lm_head. Per shape and row count:

  cublas_us     F.linear (cuBLAS), median of triton.testing.do_bench (launches back to back)
  of_rate       its FLOPs per second against the 8192^3 bf16 matmul rate measured in the run
  cublaslt_us   the same F.linear with torch's preferred BLAS set to cuBLASLt (its own heuristic
                and workspace, where cuBLAS's may pick another kernel at a narrow shape)
  autotuned_us  the same product compiled with inductor's max-autotune (its Triton templates and
                cuBLAS; --no-autotune skips it), compile and autotuning outside the timing
  tma_us        the same with inductor's persistent TMA templates added to the candidates (off by
                default in inductor): a persistent GEMM keeps every multiprocessor busy past the
                last whole wave of tiles, where a narrow output leaves them idle
  weights_us    the weight's bytes at the copy bandwidth measured in the run: the GEMM's floor
                where it is bound by the bandwidth rather than by its FLOPs

A last row per row count sums a decode step's GEMMs (36 layers, gate and up apart, the lm_head)
against the same GEMMs at the measured rate: what the step's GEMMs add over its serial floor
(bench.regenerate `floor_ms`).

    python -m bench.decode_gemms [--rows 512,256] [--no-autotune] [--gemms o,qkv]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from bench.common import QWEN3_8B, env_record, measured_bf16_peak_tflops, report
from bench.regenerate import copy_bandwidth


def step_shapes(preset: dict = QWEN3_8B) -> dict[str, tuple[int, int, int]]:
    """name -> (output width, input width, calls per step) of the decode step's GEMMs."""
    hidden, inter = preset["hidden_size"], preset["intermediate_size"]
    heads, kv, head_dim = preset["num_attention_heads"], preset["num_key_value_heads"], preset["head_dim"]
    layers = preset["num_hidden_layers"]
    return {
        "qkv": ((heads + 2 * kv) * head_dim, hidden, layers),
        "o": (hidden, heads * head_dim, layers),
        "gate_up": (inter, hidden, 2 * layers),  # gate and up: one shape, two GEMMs
        "down": (hidden, inter, layers),
        "lm_head": (preset["vocab_size"], hidden, 1),
    }


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median") * 1e3


def shape_row(rows: int, name: str, n: int, k: int, rate: float, bandwidth: float, autotune: bool) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * n * k
    us = bench_us(lambda: F.linear(x, w))
    lt_us = cublaslt_us(x, w)
    row = {
        "rows": rows,
        "gemm": name,
        "n x k": f"{n} x {k}",
        "cublas_us": round(us, 1),
        "cublaslt_us": None if lt_us is None else round(lt_us, 1),
        "of_rate": round(flops / (us * 1e-6) / rate, 3),
        "at_rate_us": round(flops / rate * 1e6, 1),
        "weights_us": round(n * k * 2 / bandwidth * 1e6, 1),
    }
    if autotune:
        row["autotuned_us"] = round(autotuned_us(x, w, persistent_tma=False), 1)
        row["tma_us"] = round(autotuned_us(x, w, persistent_tma=True), 1)
    return row


def cublaslt_us(x: torch.Tensor, w: torch.Tensor) -> float | None:
    """F.linear's median with cuBLASLt as torch's preferred BLAS (None where this torch cannot
    switch); the preference is put back after."""
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except (RuntimeError, ValueError):
        return None
    try:
        return bench_us(lambda: F.linear(x, w))
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def autotuned_us(x: torch.Tensor, w: torch.Tensor, persistent_tma: bool) -> float:
    """The product compiled with max-autotune, with or without the persistent TMA templates."""
    import torch._inductor.config as inductor_config

    # one compiled function per shape and setting: without the reset dynamo's recompile limit
    # would send the later ones to eager without a word
    torch._dynamo.reset()
    with inductor_config.patch({"triton.enable_persistent_tma_matmul": persistent_tma}):
        compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
        compiled(x, w)
    torch.cuda.synchronize()
    return bench_us(lambda: compiled(x, w))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="512,256", help="comma-separated row counts (slots)")
    p.add_argument("--no-autotune", action="store_true", help="cuBLAS and cuBLASLt only")
    p.add_argument("--gemms", default="", help="comma-separated GEMM names to time (default: every one)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rate = measured_bf16_peak_tflops() * 1e12
    bandwidth = copy_bandwidth()
    print(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    table = []
    wanted = {g.strip() for g in args.gemms.split(",") if g.strip()}
    unknown = wanted - set(step_shapes())
    if unknown:
        p.error(f"--gemms: unknown {sorted(unknown)}; known: {sorted(step_shapes())}")
    for rows in (int(r) for r in args.rows.split(",")):
        step_us = step_at_rate_us = 0.0
        for name, (n, k, calls) in step_shapes().items():
            if wanted and name not in wanted:
                continue
            row = shape_row(rows, name, n, k, rate, bandwidth, not args.no_autotune)
            print(row, flush=True)
            table.append(row)
            step_us += calls * row["cublas_us"]
            step_at_rate_us += calls * row["at_rate_us"]
        if wanted:
            continue  # the step's sum needs every GEMM
        table.append(
            {
                "rows": rows,
                "gemm": "the step's GEMMs",
                "cublas_us": round(step_us, 1),
                "of_rate": round(step_at_rate_us / step_us, 3),
                "at_rate_us": round(step_at_rate_us, 1),
            }
        )
    cols = ["rows", "gemm", "n x k", "cublas_us", "cublaslt_us", "of_rate", "at_rate_us", "weights_us"]
    if not args.no_autotune:
        cols[5:5] = ["autotuned_us", "tma_us"]
    record = {
        "env": env_record(),
        "matmul_tflops": round(rate / 1e12),
        "copy_gb_s": round(bandwidth / 1e9),
        "rows": table,
    }
    report("decode_gemms", record, "decode step GEMMs against the matmul rate", table, cols)


if __name__ == "__main__":
    main()
