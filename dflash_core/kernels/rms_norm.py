"""RMSNorm in one Triton kernel: a row's sum of squares, its scale and the weight in one pass.

Eager, a transformers RMSNorm is a chain of kernels (the cast to fp32, the square, the mean, the
reciprocal root, the product, the cast back, the weight), each reading and writing the whole
activation; in a decode step of a few hundred rows every one of them is a launch whose time is
its fixed cost, four norms per decoder layer. This kernel reads the row once and writes it once.

Two weightings, the two the transformers families use:
- `scaled` (Llama, Qwen, Mistral and their MoE kin): the normalised row is cast back to the
  input's dtype, then multiplied by the weight (the product in the promoted dtype);
- `offset` (Gemma): the normalised row times (1 + weight), both in fp32, cast to the input's dtype.
The rounding steps are those of the eager code; only the order of the row's sum differs.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it

WEIGHTINGS = ("scaled", "offset")
# elements a program holds: rows of a narrow norm (the per-head q/k norms, 64-256 wide) share a
# program, a wide row has one to itself
_TILE = 4096
MAX_WIDTH = 32768  # a wider row would not fit one program's registers


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    n_cols,
    inner,
    stride_outer,
    stride_x,
    stride_out,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    # row r of the input is (r // inner, r % inner) of a 3-D view: the heads of a token's
    # projection, read in place where they are a slice of a wider one (target_qkv.py)
    at = (rows // inner) * stride_outer + (rows % inner) * stride_x
    x = tl.load(x_ptr + at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    normed = x * rstd[:, None]
    if OFFSET:  # noqa: SIM108 - a static branch of the jit function
        y = normed * (1.0 + w[None, :])
    else:
        y = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def output_dtype(x: torch.Tensor, weight: torch.Tensor, weighting: str) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if weighting == "scaled" else x.dtype


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this input: a row of at most MAX_WIDTH elements, the weight as wide."""
    width = x.shape[-1] if x.dim() else 0
    return 0 < width <= MAX_WIDTH and weight.dim() == 1 and weight.shape[0] == width and x.numel() > 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, D] without a copy where its strides allow (the last dimension
    contiguous): [rows, 1, D] where its rows are evenly spaced, else its last two dimensions
    apart (the heads of each token in a wider projection's output); else a contiguous copy."""
    width = x.shape[-1]
    if x.stride(-1) == 1:
        with contextlib.suppress(RuntimeError):
            return x.view(-1, 1, width)
        if x.dim() >= 3:
            with contextlib.suppress(RuntimeError):
                return x.view(-1, x.shape[-2], width)
    return x.contiguous().view(-1, 1, width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weighting: str = "scaled") -> torch.Tensor:
    """RMSNorm of x [..., D] over its last dimension with weight [D] (see the module's docstring
    for the weightings); a new tensor of x's shape."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, not {weighting!r}")
    if not supports(x, weight):
        raise ValueError(f"rms_norm takes rows of 1..{MAX_WIDTH} elements and a weight as wide, not {tuple(x.shape)}")
    width = x.shape[-1]
    rows = _rows(x)
    n_rows = rows.shape[0] * rows.shape[1]
    out = torch.empty((n_rows, width), dtype=output_dtype(x, weight, weighting), device=x.device)
    block_c = triton.next_power_of_2(width)
    block_r = max(1, _TILE // block_c)
    grid = (triton.cdiv(n_rows, block_r),)
    with triton_launch_device(x.device):
        _rms_norm_kernel[grid](
            rows,
            weight.contiguous(),
            out,
            n_rows,
            width,
            rows.shape[1],
            rows.stride(0),
            rows.stride(1),
            out.stride(0),
            float(eps),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            OFFSET=weighting == "offset",
            num_warps=8 if block_c * block_r >= 4096 else 4,
        )
    return out.view(x.shape)
