"""Rotary position embedding of a layer's queries and keys in one Triton kernel.

transformers' rotate-half form, `q * cos + rotate_half(q) * sin` and the same for k (Llama,
Qwen, Mistral, Gemma and their kin), is five kernels per tensor eagerly: the two products, the
negation and the concatenation of rotate_half, the sum. In a decode step of a few hundred rows
each is a launch whose time is its fixed cost, ten per decoder layer. This kernel does both
tensors in one launch: a program per (batch row, position) and tensor, every head of it.

bf16 only, rounded where the eager code rounds: each product and the sum are rounded to bf16
(the eager ops compute in fp32 and round each result), so the output equals the eager one bit
for bit. The rounding is written as integer arithmetic on the fp32 bits (round to nearest, ties
to even): a cast to bf16 and back is folded away by Triton's compiler, which would round once
where the eager code rounds three times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it

DTYPES = (torch.bfloat16,)
MAX_HEAD_DIM = 512
MAX_HEADS = 256


@triton.jit
def _rounded(x):
    """fp32 x rounded to bf16 (nearest, ties to even), as fp32: where an eager op's result rounds.
    NaN stays NaN; a value past bf16's largest rounds to infinity, as the cast does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    heads,
    stride_h,
    out_stride_h,
    c1,
    c2,
    s1,
    s2,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    at = h[:, None] * stride_h + d[None, :]
    out_at = h[:, None] * out_stride_h + d[None, :]
    x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
    # first half: x1 * cos + (-x2) * sin; second half: x2 * cos + x1 * sin (rotate_half = [-x2, x1])
    lo = _rounded(_rounded(x1 * c1[None, :]) + _rounded(-x2 * s1[None, :]))
    hi = _rounded(_rounded(x2 * c2[None, :]) + _rounded(x1 * s2[None, :]))
    tl.store(out_ptr + out_at, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out_at + HALF, hi.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    seq,
    q_heads,
    k_heads,
    q_sb,
    q_sh,
    q_ss,
    k_sb,
    k_sh,
    k_ss,
    qo_sb,
    qo_sh,
    qo_ss,
    ko_sb,
    ko_sh,
    ko_ss,
    c_sb,
    c_ss,
    s_sb,
    s_ss,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements: a long prefill's rows
    b = row // seq
    s = row - b * seq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    cos = cos_ptr + b * c_sb + s * c_ss
    sin = sin_ptr + b * s_sb + s * s_ss
    c1 = tl.load(cos + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr + b * q_sb + s * q_ss, q_out_ptr + b * qo_sb + s * qo_ss, q_heads, q_sh, qo_sh,
            c1, c2, s1, s2, HALF, BLOCK_D, BLOCK_H,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr + b * k_sb + s * k_ss, k_out_ptr + b * ko_sb + s * ko_ss, k_heads, k_sh, ko_sh,
            c1, c2, s1, s2, HALF, BLOCK_D, BLOCK_H,
        )  # fmt: skip


def supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these: q [B, H, S, D] and k [B, Hk, S, D] with cos and sin
    [B or 1, S, D] (broadcast over the heads, as transformers' default unsqueeze_dim of 1 does), all
    of one dtype (bf16) and device, D even, the last dimension contiguous."""
    tensors = (q, k, cos, sin)
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    if any(t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1 for t in tensors) or q.dtype not in DTYPES:
        return False
    b, h, s, d = q.shape
    if d % 2 or not 0 < d <= MAX_HEAD_DIM or not 0 < max(h, k.shape[1]) <= MAX_HEADS or q.numel() == 0:
        return False
    if k.shape[0] != b or k.shape[2:] != (s, d):
        return False
    return all(t.shape[0] in (1, b) and t.shape[1:] == (s, d) for t in (cos, sin))


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * cos + rotate_half(q) * sin, the same for k), new tensors with q's and k's strides,
    rounded as the eager code rounds (see the module's docstring)."""
    if not supports(q, k, cos, sin):
        raise ValueError(
            f"apply_rope takes q [B, H, S, D], k [B, Hk, S, D], cos and sin [B or 1, S, D] of one dtype in {DTYPES}, "
            f"not {tuple(q.shape)}, {tuple(k.shape)}, {tuple(cos.shape)}"
        )
    b, _, s, d = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    half = d // 2
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_b = sin.stride(0) if sin.shape[0] > 1 else 0
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_d = triton.next_power_of_2(half)
    with triton_launch_device(q.device):
        _rope_kernel[(b * s, 2)](
            q, k, q_out, k_out, cos, sin,
            s, q.shape[1], k.shape[1],
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2),
            k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos_b, cos.stride(1), sin_b, sin.stride(1),
            HALF=half, BLOCK_D=block_d, BLOCK_H=block_h,
            num_warps=4 if block_h * block_d <= 2048 else 8,
        )  # fmt: skip
    return q_out, k_out
