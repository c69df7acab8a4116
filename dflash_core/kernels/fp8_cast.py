"""A tensor cast to FP8 with one dynamic scale, as two Triton kernels (CUDA).

The FP8 target quantizes the activations entering every decoder linear (target_precision.py).
Written with torch ops that cast is five passes over the activations with fp32 temporaries (abs,
amax, multiply, clamp, convert), run eagerly inside the target's CUDA graph; here it is two
passes: one reads the tensor for its largest magnitude (per program, then one atomic max), the
other reads it again and writes the FP8 values, zero rows appended up to the row count the FP8
GEMM takes. `python -m bench.target_capture` times the target both ways (docs/performance.md).

Same values as fp8.quantize on finite input, bit for bit on CUDA: the scale rounded as torch
rounds `max_fp8 / amax` (the reciprocal of amax, times max_fp8), the product rounded to nearest
even and saturated at the format's largest value. A NaN or an infinity in the tensor makes amax
infinite, so the scale is 0 and its inverse infinite: the GEMM's output is NaN, as with the torch
ops (whose amax is NaN), and the target's non-finite features do not pass for finite ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device

BLOCK = 2048
AMAX_ITERS = 8  # blocks per program in the amax pass: fewer atomics on the one scalar
NUM_WARPS = 8


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, tl.where(a == a, a, float("inf")))  # a NaN counts as infinite
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_kernel(x_ptr, amax_ptr, out_ptr, inv_ptr, n, n_out, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.maximum(tl.load(amax_ptr), 1e-12)
    scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), amax) * FMAX  # as torch's `FMAX / amax` rounds
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    v = x * scale
    y = tl.where(v == v, tl.minimum(tl.maximum(v, -FMAX), FMAX), v)  # saturate; a NaN stays NaN
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n_out)
    if pid == 0:
        tl.store(inv_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, K] in `dtype` with zero rows appended up to padded_rows, the inverse of its scale
    as an fp32 scalar tensor): what fp8.quantize returns for x padded with zero rows."""
    rows, cols = x.shape
    if padded_rows < rows:
        raise ValueError(f"padded_rows {padded_rows} < rows {rows}")
    x = x.contiguous()
    out = torch.empty(padded_rows, cols, dtype=dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    n, n_out = x.numel(), out.numel()
    with triton_launch_device(x.device):
        _amax_kernel[(max(1, triton.cdiv(n, BLOCK * AMAX_ITERS)),)](
            x, amax, n, BLOCK=BLOCK, ITERS=AMAX_ITERS, num_warps=NUM_WARPS
        )
        _cast_kernel[(max(1, triton.cdiv(n_out, BLOCK)),)](
            x, amax, out, inv, n, n_out, FMAX=torch.finfo(dtype).max, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return out, inv
