"""A sampled decode step's next tokens, Gumbel-max, in one Triton kernel.

The decoder samples with counter-based noise (regenerate/sampling.py: a hash of each sequence's
seed, its step and the vocabulary index, then -log(-log(u))) added to the temperature-scaled
logits, and takes each row's argmax. Eagerly that noise is a dozen int64 passes over a
[slots, vocabulary] tensor (gigabytes moved at 512 slots and a 150K vocabulary), then the sum and
the argmax. Here a program per row reads its logits once, hashes the noise in registers and keeps
the row's running maximum: the same integer hash, the same float operations in the same order
(the division correctly rounded as torch's; the logarithms round as torch's CUDA ones, which the
GPU tests check by the tokens), and among equal maxima the first index, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it
from .top_p import key_shift, ordered_key

BLOCK = 4096  # vocabulary entries a program holds per pass over its row


@triton.jit
def _mix32(x):
    """lowbias32 on uint32, whose products wrap as regenerate/sampling.py's int64 ones masked to 32
    bits (a quarter of the integer work of 64-bit products)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits, row_stride, vocab, temperature, seeds, steps, floor, out,
    BLOCK: tl.constexpr, FLOOR: tl.constexpr, SHIFT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = tl.load(temperature)
    seed = (tl.load(seeds + row) & 0xFFFFFFFF).to(tl.uint32)
    step = (tl.load(steps + row) & 0xFFFFFFFF).to(tl.uint32)
    base = _mix32(_mix32(seed) + step)  # the sum wraps as the int64 one masked to 32 bits
    start = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.full([], 0, tl.int64)
    src = logits + row.to(tl.int64) * row_stride
    if FLOOR:
        least = tl.load(floor + row)
    for first in range(0, vocab, BLOCK):
        idx = first + start
        inside = idx < vocab
        x = tl.load(src + idx, mask=inside, other=float("-inf")).to(tl.float32)
        h = _mix32(base ^ _mix32(idx.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32)))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        y = tl.div_rn(x, t) + -tl.log(-tl.log(u))
        y = tl.where(inside, y, float("-inf"))
        if FLOOR:  # top-p's cut (top_p.py): the tokens below the row's floor are out
            y = tl.where(ordered_key(x, SHIFT) >= least, y, float("-inf"))
        top = tl.max(y, axis=0)
        at = tl.argmax(y, axis=0, tie_break_left=True)
        better = top > best  # strictly: an equal maximum further on keeps the first index
        best_at = tl.where(better, first + at.to(tl.int64), best_at)
        best = tl.maximum(best, top)
    tl.store(out + row, best_at)


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """argmax over v of logits[r, v] / temperature + gumbel_noise(seeds, steps)[r, v] for every
    row r: logits [N, V] in any float dtype (read as fp32), temperature a one-element fp32
    tensor (read on the device: a recorded graph replays with what it holds then), seeds and
    steps [N] int64. floor: [N] int32 keys from top_p.top_p_floor on the same logits, the
    tokens below a row's floor left out. [N] int64 tokens."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1 or seeds.shape != (n,) or steps.shape != (n,) or temperature.numel() != 1:
        raise ValueError(
            f"gumbel_argmax takes logits [N, V] with a contiguous last dimension, seeds and steps [N] and one "
            f"temperature, not {tuple(logits.shape)} (strides {logits.stride()}), {tuple(seeds.shape)}, "
            f"{tuple(steps.shape)}, {temperature.numel()} temperatures"
        )
    if floor is not None and (floor.shape != (n,) or floor.dtype != torch.int32):
        raise ValueError(f"gumbel_argmax takes a floor of [N] int32 keys, not {tuple(floor.shape)} {floor.dtype}")
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    with triton_launch_device(logits.device):
        _gumbel_argmax_kernel[(n,)](
            logits, logits.stride(0), vocab, temperature.float(), seeds.contiguous(), steps.contiguous(),
            floor if floor is not None else out, out,
            BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), FLOOR=floor is not None,
            SHIFT=key_shift(logits.dtype), num_warps=8,
        )  # fmt: skip
    return out
