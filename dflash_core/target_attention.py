"""The target's attention inside its compiled decoder layers (target_fusion.py): flex_attention
over the blocks the packed sequence's mask keeps, in place of SDPA under the whole mask.

A capture hands every layer a boolean mask [1, 1, S, S] (target.packed_masks: causal, within one
document, and within the window of a sliding layer). SDPA given a mask computes every query
against every key and masks afterwards: the whole S x S square, where causal attention needs half
of it and packed documents less. flex_attention skips the 128 x 128 tiles the mask leaves empty
and evaluates the mask only in the tiles it cuts; which tiles those are comes from the mask
itself, so every mask transformers builds (sliding, chunked, per document) keeps its meaning.

It runs only while dynamo traces (flex_attention is a compiled kernel; run eagerly it falls back
to a dense reference), and only where it gives SDPA's answer up to rounding: a boolean mask of
one sequence whose length is whole tiles, no softcapping, no attention sinks, no dropout.
Everything else, and every eager caller of the target, gets transformers' own SDPA function.

Every layer of a pattern gets the same mask, so its BlockMask (the tile lists: reductions over
the S x S mask and a sort) is built once per forward, outside the compiled layers (BlockMasks),
and handed to each layer's attention with its keyword arguments (BLOCK_MASK); built inside, it
would be part of the compiled layer's graph, compiled with it and run again in every layer.
"""

from __future__ import annotations

from typing import Any

import torch

from .step.attention import tile_lists

TILE = 128  # flex_attention's tile: the BlockMask's granularity on queries and keys
# the keyword argument that carries a layer's BlockMask from its caller to its attention function,
# through the decoder layer's and the attention module's **kwargs
BLOCK_MASK = "packed_block_mask"


def tile_masks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a boolean mask [S, S] (S a multiple of TILE): which (query tile, key tile) pairs some
    query sees some key of (touched), and which it sees whole (full), each [S/TILE, S/TILE]."""
    n = mask.shape[-1] // TILE
    tiles = mask.reshape(n, TILE, n, TILE)
    return tiles.any(dim=3).any(dim=1), tiles.all(dim=3).all(dim=1)


def block_mask_of(mask: torch.Tensor):
    """The BlockMask of a boolean [1, 1, S, S] mask: the full tiles skip the mask, the partial
    ones read it, the others are not visited."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = mask[0, 0]
    touched, full = tile_masks(dense)
    partial = touched & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[q_idx, kv_idx]

    kv_num, kv_idx = tile_lists(partial)
    full_num, full_idx = tile_lists(full)
    seq = dense.shape[-1]
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(seq, seq),
        compute_q_blocks=False,  # forward only: no backward reads the transposed tiles
    )


def whole_tiles(mask: Any) -> bool:
    """Whether `mask` is a boolean mask [1, 1, S, S] of whole tiles: one flex_attention can read."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[:2] == (1, 1)
        and mask.shape[2] == mask.shape[3]
        and mask.shape[3] % TILE == 0
    )


class BlockMasks:
    """The BlockMask of each distinct attention mask of one forward, built on first request. Keyed
    by the mask tensor itself (held here, so its id stays its own for the forward's length)."""

    def __init__(self) -> None:
        self._built: dict[int, tuple[torch.Tensor, Any]] = {}

    def of(self, mask: Any) -> Any:
        """The BlockMask of `mask`, or None where flex could not read it (whole_tiles)."""
        if not whole_tiles(mask):
            return None
        if id(mask) not in self._built:
            self._built[id(mask)] = (mask, block_mask_of(mask))
        return self._built[id(mask)][1]

    def __len__(self) -> int:
        return len(self._built)


def takes_flex(module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, dropout: float, kwargs: dict) -> bool:
    """Whether flex_attention gives this call SDPA's answer (see the module's docstring); the
    caller adds that it runs compiled on a GPU."""
    if not whole_tiles(mask):
        return False
    b, hq, s, _ = query.shape
    return (
        b == 1
        and mask.shape[2] == s
        and key.shape[2] == s
        and hq % key.shape[1] == 0
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and getattr(module, "sinks", None) is None
    )


def packed_attention(sdpa: Any):
    """transformers' SDPA attention function with the flex path in front of it. The flex path
    takes the mask's BlockMask from the BLOCK_MASK keyword where the caller built it (the fused
    layers: BlockMasks), and builds it itself for a compiled caller that hands none in."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        block_mask = kwargs.pop(BLOCK_MASK, None)
        compiled = query.is_cuda and torch.compiler.is_compiling()
        if not (compiled and takes_flex(module, query, key, attention_mask, dropout, kwargs)):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(
            query,
            key,
            value,
            block_mask=block_mask if block_mask is not None else block_mask_of(attention_mask),
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    attention.sdpa = sdpa  # type: ignore[attr-defined]
    return attention


def use_packed_attention(enabled: bool = True) -> None:
    """Put the flex path in front of transformers' "sdpa" attention (or take it out). The
    implementation name stays "sdpa": the masks are built for it, and the compiled layers'
    guards see one attention function for the life of the process."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    current = AttentionInterface._global_mapping.get("sdpa", sdpa_attention_forward)
    plain = getattr(current, "sdpa", None)
    if enabled and plain is None:
        AttentionInterface.register("sdpa", packed_attention(current))
    elif not enabled and plain is not None:
        AttentionInterface.register("sdpa", plain)
