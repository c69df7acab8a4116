"""How large a slot decoder (decode.SlotDecoder) is: its cache per token, what it holds beside
the cache, the slots a device's free memory takes, and a model's weight bytes."""

from __future__ import annotations

import torch
from torch import nn

from ..target_qkv import QkvDispatch


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Cache bytes one token takes over every layer (keys and values)."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * int(config.num_hidden_layers) * heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def decoder_bytes(model: nn.Module) -> int:
    """Device bytes a decoder of the model holds beside its cache with its kernels on (CUDA's
    default): the stacked q/k/v weights."""
    return QkvDispatch.of(model).stacked_bytes()


def slots_for_memory(free_bytes: int, per_token: int, length: int, cap: int = 512, share: float = 0.85) -> int:
    """Slots whose cache of `length` positions fits `share` of `free_bytes` (what the device has
    left: the decode step's activations and the sampler's scratch need the rest), a multiple of
    8, at most `cap` (the weights are read once per step whatever the slots: past a few hundred
    slots the cache dominates the bytes a step reads, and more slots add little), at least 1."""
    n = int(free_bytes * share) // max(1, per_token * length)
    n = min(cap, n)
    return max(1, n - n % 8 if n >= 8 else n)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (an FP8 linear keeps its weight and scale as
    buffers), a tensor shared by several modules (tied embeddings) once."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())
