"""The slot decoder's attention (decode.SlotDecoder), registered with transformers as
SLOT_ATTENTION, and what the decoder hands it in place of a mask.

A decode step has one query per row: one per slot, and one per prompt token riding in the step
(ride.py), each at its own position of its slot's cache. Its attention takes, per layer kind
(full, sliding), either a mask over the whole static cache (the CPU, and CUDA without the kernel:
a batched GEMM of the grouped queries against every cache position, masked; a riding row's slot's
keys gathered by the cache) or the rows' valid ranges (CUDA: the Triton kernel of
kernels/decode_attention.py reads only those positions, of the cache row a range names).

A prefill has the prompts' queries against their own keys. Prompts are right-padded, so under
plain causal attention a prompt's query at position i sees its keys 0..i, all real, and a padding
key is seen by padding queries only, whose outputs nobody reads: where no sliding window cuts in,
the attention is SDPA's own causal one (the flash and cuDNN backends take it, the keys shared by
their query heads), with no mask. A sliding layer whose prompts are wider than its window takes
the window as a boolean mask.

Ranges and the causal marker travel where the mask would: as the entry of the per-layer-kind dict
the model's forward takes in place of `attention_mask` (or as the one mask of a model with one
layer kind), so they reach each layer the way its mask would, with no state beside the forward.
They are 4D tensors, as a prepared mask is, which transformers' mask builders hand on as given;
their integer dtypes, which no mask has (int32 the ranges, int64 the causal marker), are how
slot_attention tells them apart.
"""

from __future__ import annotations

import torch

SLOT_ATTENTION = "dflash_slots"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_ranges(
    positions: torch.Tensor, window: int | None, parked: int | None = None, slot_of: torch.Tensor | None = None
) -> torch.Tensor:
    """The cache positions [lo, hi) each slot's query sees, as int32 [slots, 1, 1, 2]: hi is the
    slot's position plus one (the key written this step is seen); lo is 0, or hi - window for a
    sliding layer (the keys at positions > position - window, the rule of the masks). A slot at
    position `parked` holds no sequence (decode.SlotDecoder parks them there): it sees the one key
    it writes, so an idle slot reads one position, not its whole cache. With slot_of (the slot of
    each query, where a step has more queries than slots: ride.py), [rows, 1, 1, 3]: (lo, hi, slot)."""
    hi = positions + 1
    lo = (hi - int(window)).clamp(min=0) if window else torch.zeros_like(hi)
    if parked is not None:
        lo = torch.where(positions == parked, positions, lo)
    cols = (lo, hi) if slot_of is None else (lo, hi, slot_of)
    return torch.stack(cols, dim=-1).to(torch.int32).view(-1, 1, 1, len(cols))


def is_ranges(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int32


def prefill_causal(device: torch.device | str) -> torch.Tensor:
    """The stand-in for a prefill layer's mask that means plain causal attention over the prompts:
    a 4D int64 tensor (its one value is never read)."""
    return torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)


def is_causal(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int64


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
    """With ranges (decode_ranges, one query per row): the Triton kernel over each row's valid
    positions of its slot's cache. With the causal marker (prefill_causal: a prefill, the prompts' own keys): SDPA's
    causal attention, each key-value head's keys shared by its query heads (enable_gqa), which its
    flash backend takes as they are. With one query per slot and a mask: the query heads of each
    key-value head multiplied against that head's keys in one batched GEMM, so the cache is read
    once per step (one query per row: the keys are the rows' own, gathered by the cache where
    rows ride) (SDPA given a mask repeats the keys and values for every query head: a copy of
    the whole cache per layer and step). With several queries and a mask (a prefill's sliding
    layers wider than the window): SDPA over keys repeated per query head, which its
    memory-efficient backend takes with the mask. A mask is [N, 1, Q, K] (or [1, 1, Q, K], the
    same for every row): boolean (True where a query sees a key), or additive in the model's
    dtype (0 or -inf), built once per step for every layer, so the scores take one pass to mask."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError("regeneration does not decode attention with sinks")
    if kwargs.get("softcap") is not None:  # Gemma 2's attn_logit_softcapping: no path here caps scores
        raise ValueError("regeneration does not decode attention with soft-capped scores")
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    scale = scaling if scaling is not None else d**-0.5
    if is_ranges(attention_mask):
        if q != 1:
            raise ValueError("slot ranges stand for the mask of a decode step (one query per row)")
        from ..kernels.decode_attention import decode_attention

        out = decode_attention(query[:, :, 0], key, value, attention_mask.view(b, -1), scale)
        return out.view(b, 1, hq, d), None  # [b, 1, hq, d]: the layout of query.transpose(1, 2)
    if is_causal(attention_mask):
        if key.shape[2] != q:
            raise ValueError("causal prefill attention takes the prompts' own keys, one per query")
        if groups > 1 and query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
            # flash is 16-bit only; the backend that takes fp32 (memory-efficient) may not take
            # grouped heads, and the math one would hold every head's scores: repeat the keys
            key, value, groups = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), 1
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out = sdpa(query, key, value, is_causal=True, scale=scale, enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
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
