"""A decode step's new keys and values written into the static cache in one Triton kernel.

Eagerly, `cache[slot_index, :, positions] = new[:, :, 0]` is an advanced-index put per tensor:
the index tensors broadcast and linearised, then the put, several launches for the keys and as
many for the values, per decoder layer, each a fixed cost at a decode step's few hundred rows.
This kernel writes both tensors in one launch: a program per slot and tensor, every head of it.
A copy: the cache holds exactly what the eager put would, for positions inside the cache. A
position (or a given slot) outside it writes nothing, where the eager put would wrap a negative one or raise: a
recorded graph cannot raise, and the decoder's positions stay inside the cache.

The new rows are one per slot, or any number with the slot of each given (`slots`): a chunked
prefill's prompt tokens ride in the decode step as rows of their own (regenerate/ride.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it

MAX_ELEMENTS = 1 << 16  # one slot's heads x head_dim a program holds


@triton.jit
def _copy_heads(
    src, dst, heads, src_h, dst_h, ok, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :] & ok
    row = tl.load(src + h[:, None] * src_h + d[None, :], mask=mask)
    tl.store(dst + h[:, None] * dst_h + d[None, :], row, mask=mask)


@triton.jit
def _slot_write_kernel(
    k_new,
    v_new,
    k_cache,
    v_cache,
    positions,
    slots,
    slots_n,
    length,
    heads,
    kn_s,
    kn_h,
    vn_s,
    vn_h,
    kc_s,
    kc_h,
    kc_p,
    vc_s,
    vc_h,
    vc_p,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS_GIVEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements: a large cache's slots
    pos = tl.load(positions + row)
    if SLOTS_GIVEN:  # noqa: SIM108 - a static branch of the jit function
        slot = tl.load(slots + row).to(tl.int64)
    else:
        slot = row
    ok = (pos >= 0) & (pos < length) & (slot >= 0) & (slot < slots_n)  # never a write outside the cache
    if tl.program_id(1) == 0:
        _copy_heads(
            k_new + row * kn_s, k_cache + slot * kc_s + pos * kc_p, heads, kn_h, kc_h, ok, HEAD_DIM, BLOCK_H, BLOCK_D
        )
    else:
        _copy_heads(
            v_new + row * vn_s, v_cache + slot * vc_s + pos * vc_p, heads, vn_h, vc_h, ok, HEAD_DIM, BLOCK_H, BLOCK_D
        )


def supports(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots_given: bool = False
) -> bool:
    """Whether the kernel takes these: caches [slots, heads, length, D] and one new position per
    slot [slots, heads, 1, D] (slots_given: [rows, heads, 1, D], any number of rows), of one dtype
    and device, every last dimension contiguous."""
    tensors = (k_cache, v_cache, k_new, v_new)
    if any(t.dim() != 4 or t.dtype != k_cache.dtype or t.device != k_cache.device for t in tensors):
        return False
    if any(t.stride(-1) != 1 for t in tensors) or v_cache.shape != k_cache.shape:
        return False
    slots, heads, _, dim = k_cache.shape
    new_shape = (k_new.shape[0] if slots_given else slots, heads, 1, dim)
    return k_new.shape == new_shape and v_new.shape == new_shape and 0 < heads * dim <= MAX_ELEMENTS


def write_slots(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> None:
    """k_cache[s, :, positions[s]] = k_new[s, :, 0] for every slot s, and the same for the values
    (a position outside the cache writes nothing); with `slots` [rows], row r of the new ones
    goes to slot slots[r] at positions[r]."""
    rows = k_new.shape[0]
    given = slots is not None
    if not supports(k_cache, v_cache, k_new, v_new, given) or positions.shape != (rows,):
        raise ValueError(
            f"write_slots takes caches [slots, heads, length, D], new rows [rows, heads, 1, D] (rows = slots "
            f"unless each row's slot is given) and positions [rows], not {tuple(k_cache.shape)}, "
            f"{tuple(k_new.shape)}, {tuple(positions.shape)}"
        )
    if slots is not None and slots.shape != (rows,):
        raise ValueError(f"write_slots takes a slot per new row, [{rows}], not {tuple(slots.shape)}")
    _, heads, length, dim = k_cache.shape
    with triton_launch_device(k_cache.device):
        _slot_write_kernel[(rows, 2)](
            k_new, v_new, k_cache, v_cache, positions.contiguous(),
            slots.contiguous() if slots is not None else positions, k_cache.shape[0], length, heads,
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
            SLOTS_GIVEN=given, num_warps=4,
        )  # fmt: skip
