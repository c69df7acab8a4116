"""The top-p cut of each row of logits without sorting it: a threshold found by bisection.

Top-p keeps the smallest set of a row's most probable tokens whose probability reaches p. Sorted,
that is a sort of every row of [slots, vocabulary] (several passes over it, and the largest part
of a sampled step at a few hundred slots). But the kept set is a threshold on the logit: token i
is kept when the probability of the tokens strictly more probable than it is below p, which holds
for every value at or above some floor and for none below it. A program per row finds that floor
by bisection over the logits' bit patterns read as ordered integers (16 steps for bf16 logits,
whose fp32 values have 16 bits; 32 for fp32): each step one pass over the row summing the
probability above the middle key, where a sort moves the whole row through several passes and
writes it and its order back. The sampling kernel (gumbel_max.py) then takes the row's tokens at
or above its floor.

Tied logits are kept or cut together (a cut by rank keeps whichever of them the sort put first);
regenerate/sampling.py's `nucleus` treats ties the same way, so the two agree but for the
rounding of the sums (the sort's cumulative sum runs in another order), within a float's step
of p. One more difference, with fp32 logits only: the floor compares the logits, the sorted cut
the logits divided by the temperature, where two values a float's step apart can become one
(bf16 and fp16 values are too far apart for that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it

BLOCK = 4096  # vocabulary entries a program holds per pass over its row


def key_shift(dtype: torch.dtype) -> int:
    """The low bits of an fp32 value read from `dtype` that are always zero: the keys drop them,
    so the bisection runs over the bits the logits have (16 for bf16, 13 for fp16)."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


@triton.jit
def ordered_key(x, SHIFT: tl.constexpr):
    """fp32 x as an int32 that orders as the values do (negatives' magnitude bits reversed), its
    SHIFT low bits dropped; -0.0 has +0.0's key (the values are equal, and a tie is one value)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0's pattern, 0x80000000
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _top_p_floor_kernel(logits, row_stride, vocab, temperature, top_p, floor, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperature)
    p = tl.load(top_p)
    src = logits + row.to(tl.int64) * row_stride
    start = tl.arange(0, BLOCK)
    # the row's largest scaled logit and its softmax normaliser, online; its smallest and largest key
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.full([], 0.0, tl.float32)
    lo = tl.full([], 2147483647, tl.int64)
    hi = tl.full([], -2147483648, tl.int64)
    for first in range(0, vocab, BLOCK):
        idx = first + start
        inside = idx < vocab
        x = tl.load(src + idx, mask=inside, other=float("-inf")).to(tl.float32)
        s = tl.div_rn(x, t)
        top = tl.maximum(m, tl.max(s, axis=0))
        # rescaled where the maximum moved (not while every value so far is -inf: -inf - -inf is NaN)
        # and no term from a -inf logit, which is NaN while the maximum so far is -inf too
        terms = tl.where(inside & (s > float("-inf")), tl.exp(s - top), 0.0)
        z = z * tl.where(m == top, 1.0, tl.exp(m - top)) + tl.sum(terms, axis=0)
        m = top
        k = ordered_key(x, SHIFT).to(tl.int64)
        lo = tl.minimum(lo, tl.min(tl.where(inside, k, 2147483647), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(inside, k, -2147483648), axis=0))
    # the smallest key whose strictly larger keys hold less than p of the mass: above the largest
    # key they hold none (so hi qualifies), below the smallest they hold all of it (lo does not)
    lo = lo - 1
    goal = p * z
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        above = tl.full([], 0.0, tl.float32)
        for first in range(0, vocab, BLOCK):
            idx = first + start
            inside = idx < vocab
            x = tl.load(src + idx, mask=inside, other=float("-inf")).to(tl.float32)
            k = ordered_key(x, SHIFT).to(tl.int64)
            w = tl.exp(tl.div_rn(x, t) - m)
            above += tl.sum(tl.where(inside & (k > mid), w, 0.0), axis=0)
        hi = tl.where(above < goal, mid, hi)
        lo = tl.where(above < goal, lo, mid)
    tl.store(floor + row, hi.to(tl.int32))


def top_p_floor(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, V] (contiguous last dimension), the smallest ordered key
    (`ordered_key` with `key_shift(logits.dtype)`) of the tokens top-p keeps from
    softmax(logits / temperature): [N] int32. temperature and top_p are one-element fp32 tensors
    read on the device (a recorded graph replays with what they hold then); top_p below 1."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1 or temperature.numel() != 1 or top_p.numel() != 1:
        raise ValueError(
            f"top_p_floor takes logits [N, V] with a contiguous last dimension and one temperature and top_p, "
            f"not {tuple(logits.shape)} (strides {logits.stride()})"
        )
    floor = torch.empty(n, dtype=torch.int32, device=logits.device)
    if n == 0:
        return floor
    with triton_launch_device(logits.device):
        _top_p_floor_kernel[(n,)](
            logits, logits.stride(0), vocab, temperature.float(), top_p.float(), floor,
            SHIFT=key_shift(logits.dtype), BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), num_warps=8,
        )  # fmt: skip
    return floor
