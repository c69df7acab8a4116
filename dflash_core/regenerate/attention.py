"""The slot decoder's attention (decode.SlotDecoder), registered with transformers as
SLOT_ATTENTION, and what a decode step hands it in place of a mask.

A decode step has one query per slot. Its attention takes, per layer kind (full, sliding), either
a mask over the whole static cache (the CPU, and CUDA without the kernel: a batched GEMM of the
grouped queries against every cache position, masked) or the slots' valid ranges (CUDA: the
Triton kernel of kernels/decode_attention.py reads only those positions). The ranges travel
where the mask would: as the entry of the per-layer-kind dict the model's forward takes in place
of `attention_mask` (or as the one mask of a model with one layer kind), so they reach each layer
the way its mask would, with no state beside the forward. They are a 4D tensor, as a prepared
mask is, which transformers' mask builders hand on as given; int32, which no mask is, is how
slot_attention tells them apart.
"""

from __future__ import annotations

import torch

SLOT_ATTENTION = "dflash_slots"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_ranges(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """The cache positions [lo, hi) each slot's query sees, as int32 [slots, 1, 1, 2]: hi is the
    slot's position plus one (the key written this step is seen); lo is 0, or hi - window for a
    sliding layer (the keys at positions > position - window, the rule of the masks)."""
    hi = positions + 1
    lo = (hi - int(window)).clamp(min=0) if window else torch.zeros_like(hi)
    return torch.stack((lo, hi), dim=-1).to(torch.int32).view(-1, 1, 1, 2)


def is_ranges(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int32


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a decode step on `device` in `dtype` can attend through the Triton kernel."""
    if device.type != "cuda" or dtype not in KERNEL_DTYPES:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """With one query per slot and ranges (decode_ranges): the Triton kernel over each slot's
    valid positions. With one query per slot and a mask: the query heads of each key-value head
    multiplied against that head's keys in one batched GEMM, so the cache is read once per step
    (SDPA given a mask repeats the keys and values for every query head: a copy of the whole
    cache per layer and step). With several queries (a prefill): SDPA over keys repeated per
    head. A mask is [N, 1, Q, K]: boolean (True where a query sees a key), or additive in the
    model's dtype (0 or -inf), built once per step for every layer, so the scores take one pass
    to mask."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError("regeneration does not decode attention with sinks")
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    scale = scaling if scaling is not None else d**-0.5
    if is_ranges(attention_mask):
        if q != 1:
            raise ValueError("slot ranges stand for the mask of a decode step (one query per slot)")
        from ..kernels.decode_attention import decode_attention

        out = decode_attention(query[:, :, 0], key, value, attention_mask.view(b, 2), scale)
        return out.view(b, 1, hq, d), None  # [b, 1, hq, d]: the layout of query.transpose(1, 2)
    if q == 1:
        scores = torch.matmul((query * scale).view(b, hkv, groups, d), key.transpose(-1, -2))
        mask = attention_mask.view(b, 1, 1, -1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(dim=-1)  # accumulates in fp32 for 16-bit scores
        out = torch.matmul(probs, value)  # [b, hkv, groups, d]
        return out.view(b, hq, 1, d).transpose(1, 2).contiguous(), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
