"""Attention of one query per sequence over a static KV cache, as split-K Triton kernels (CUDA):
the decode step of the regeneration decoder (regenerate/attention.py).

A decode step is bound by the bytes it reads, and at hundreds of sequences the cache is most of
them. Attention through a mask over the whole static cache reads every position of it, also the
positions a sequence has not reached yet; these kernels read only each sequence's valid
positions [lo, hi) (hi: its position plus one; lo: 0, or hi minus the window of a sliding layer),
taken from a device tensor, so the launch has fixed shapes, needs no host sync and a CUDA graph
records it once for every step.

The grid is sequences x kv heads x splits. A program loads the query heads that share its kv
head (GQA: the group is one tile, so each key and value is read once for all of them, and the
scores are one tensor-core product) and walks its split's positions in blocks, with the online
softmax in fp32; a split past a sequence's valid range runs no block. With one split a program
writes the normalised output; with several it writes its unnormalised sum, maximum and
denominator, and a second kernel combines the splits. Splits exist for few sequences (a grid of
sequences x kv heads alone would leave most of the device idle); at hundreds of sequences one
split is enough and the partial sums are never written.

A query reads the cache row of its own index, or the row its range names (a third column): so
several queries may read one sequence's cache, each at its own position, as the prompt tokens of
a chunked prefill do beside the decode step's queries (regenerate/ride.py).

Same function as softmax(q k^T * scale masked to [lo, hi)) v with fp32 accumulation; tests compare
it with a float64 reference through Triton's interpreter on CPU (tests/decode_attention_check.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import INTERPRETED

BLOCK_N = 64  # cache positions per block of a program's walk (half that past head dim 128, so
# the pipelined key and value tiles of a program keep to the same shared memory)
NUM_WARPS = 4
NUM_STAGES = 2
WAVES = 4  # splits are added until the grid holds this many programs per streaming multiprocessor
MIN_SPLIT = 256  # positions: a shorter split costs more in partial sums than it gains in parallelism
_LOG2E = 1.4426950408889634
# Triton's interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bfloat16 tiles as their raw bits:
# there the operands of tl.dot go to fp32 first, which gives the products a bf16 tensor-core dot
# with fp32 accumulation gives (a bf16 value is exact in fp32)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    # FP32: both operands as fp32, multiplied exactly (fp32 caches, and the interpreter); else the
    # tensor cores' native product of 16-bit operands, accumulated in fp32
    if FP32:  # noqa: SIM108 - a static branch of the jit function, each a different dot
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ranges_ptr,
    out_ptr,
    acc_ptr,
    ml_ptr,
    sq_b,
    sq_h,
    sk_b,
    sk_h,
    sk_n,
    sv_b,
    sv_h,
    sv_n,
    so_b,
    so_h,
    groups,
    head_dim,
    split_len,
    qk_scale,
    RANGE_COLS: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo = tl.load(ranges_ptr + RANGE_COLS * b)
    hi = tl.load(ranges_ptr + RANGE_COLS * b + 1)
    if RANGE_COLS == 3:  # noqa: SIM108 - a static branch of the jit function: the cache row this query reads
        cache_row = tl.load(ranges_ptr + RANGE_COLS * b + 2).to(tl.int64)
    else:
        cache_row = b.to(tl.int64)
    start = tl.maximum(lo, split * split_len)
    end = tl.minimum(hi, (split + 1) * split_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * groups + g
    g_ok = g < groups
    d_ok = d < head_dim
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + heads[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + cache_row * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + cache_row * sv_b + kvh.to(tl.int64) * sv_h

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)  # noqa: E741 - the softmax denominator, as the literature names it
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None].to(tl.int64) * sk_n + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), FP32)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        v = tl.load(v_base + n[:, None].to(tl.int64) * sv_n + d[None, :], mask=kv_mask, other=0.0)
        pv = _dot(p.to(v.dtype), v, FP32)  # p rounded to the cache's dtype, as the eager path's probs
        acc = acc * alpha[:, None] + pv
        m = m_new

    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        o = out_ptr + b64 * so_b + heads[:, None] * so_h + d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials [batch, q heads, SPLITS, BLOCK_D] and [batch, q heads, SPLITS, 2] (max, denominator)
        row = (b64 * groups * tl.num_programs(1) + heads) * SPLITS + split
        tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + row * 2, m, mask=g_ok)
        tl.store(ml_ptr + row * 2 + 1, l, mask=g_ok)


@triton.jit
def _combine_kernel(
    acc_ptr,
    ml_ptr,
    out_ptr,
    so_b,
    so_h,
    heads_per_seq,
    head_dim,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < SPLITS
    row = (b.to(tl.int64) * heads_per_seq + h) * SPLITS + s
    m = tl.load(ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)  # noqa: E741
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no valid position at all: zeros, not NaN
    w = tl.where(s_ok & (l > 0), tl.exp2(m - top), 0.0)  # a split with no position weighs nothing
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=(w > 0)[:, None], other=0.0)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o = out_ptr + b.to(tl.int64) * so_b + h * so_h + d
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def split_count(batch: int, kv_heads: int, length: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Splits of the cache length per (sequence, kv head): enough programs for WAVES per
    streaming multiprocessor, no split shorter than MIN_SPLIT positions. A function of the
    shapes only, so a recorded graph keeps it."""
    # Triton's interpreter (no device to ask): what a large GPU would choose
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    wanted = math.ceil(WAVES * sms / max(1, batch * kv_heads))
    most = max(1, length // max(MIN_SPLIT, block_n))
    return max(1, min(wanted, most))


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ranges: torch.Tensor,
    scale: float,
    *,
    splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per sequence over its cache positions [lo, hi).

    query [B, Hq, D]; key, value [R, Hkv, L, D] (Hq a multiple of Hkv; their last dimension
    contiguous); ranges int32 [B, 2]: (lo, hi) per query, 0 <= lo < hi <= L, query b reading
    cache row b (R = B); or [B, 3]: (lo, hi, row), the cache row each query reads, 0 <= row < R.
    Returns [B, Hq, D]
    in the query's dtype. splits: the cache length is cut in this many ranges processed apart
    (None: split_count); block_n (None: BLOCK_N's rule), num_warps, num_stages (None: NUM_WARPS,
    NUM_STAGES): launch settings."""
    b, hq, d = query.shape
    kb, hkv, length, kd = key.shape
    cols = ranges.shape[-1] if ranges.dim() == 2 else 0
    if (kb != b and cols != 3) or kd != d or value.shape != key.shape or hq % hkv:
        raise ValueError(f"query {list(query.shape)} does not match keys {list(key.shape)}, {list(value.shape)}")
    query = query if query.stride(-1) == 1 else query.contiguous()
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dimension contiguous")
    if ranges.dtype != torch.int32 or tuple(ranges.shape) not in ((b, 2), (b, 3)) or not ranges.is_contiguous():
        raise ValueError(
            f"ranges must be a contiguous int32 [{b}, 2] or [{b}, 3] tensor, not {ranges.dtype} {list(ranges.shape)}"
        )
    groups = hq // hkv
    block_n = block_n or (BLOCK_N if d <= 128 else BLOCK_N // 2)
    num_warps = num_warps or NUM_WARPS
    num_stages = num_stages or NUM_STAGES
    splits = split_count(b, hkv, length, query.device, block_n) if splits is None else max(1, int(splits))
    split_len = triton.cdiv(length, splits)
    block_d = max(16, triton.next_power_of_2(d))
    block_g = max(16, triton.next_power_of_2(groups))  # tl.dot takes 16 rows at least
    out = torch.empty(b, hq, d, dtype=query.dtype, device=query.device)
    if splits > 1:
        acc = torch.empty(b, hq, splits, block_d, dtype=torch.float32, device=query.device)
        ml = torch.empty(b, hq, splits, 2, dtype=torch.float32, device=query.device)
    else:
        acc = ml = out  # unread with one split
    with triton_launch_device(query.device):
        _split_kernel[(b, hkv, splits)](
            query,
            key,
            value,
            ranges,
            out,
            acc,
            ml,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            value.stride(0),
            value.stride(1),
            value.stride(2),
            out.stride(0),
            out.stride(1),
            groups,
            d,
            split_len,
            float(scale) * _LOG2E,
            RANGE_COLS=cols,
            SPLITS=splits,
            BLOCK_G=block_g,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            FP32=query.dtype == torch.float32 or INTERPRETED,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits > 1:
            _combine_kernel[(b, hq)](
                acc,
                ml,
                out,
                out.stride(0),
                out.stride(1),
                hq,
                d,
                SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_D=block_d,
                num_warps=num_warps,
            )
    return out
