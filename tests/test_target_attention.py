"""The target's packed attention (target_attention.py) on the CPU: the BlockMask it builds from
a packed sequence's mask visits every tile the mask keeps and skips the mask only in tiles it
keeps whole, for full and sliding layers; the calls it leaves to SDPA; and that outside a
compiled trace it is transformers' SDPA bit for bit. The compiled flex path against SDPA runs on
the GPU (tests/gpu/test_target_fusion_gpu.py)."""

import pytest
import torch
from transformers import AutoConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.target import packed_masks
from dflash_core.target_attention import (
    BLOCK_MASK,
    TILE,
    BlockMasks,
    block_mask_of,
    packed_attention,
    takes_flex,
    tile_masks,
    use_packed_attention,
)

S = 4 * TILE


def _masks(assets_dir, sliding: int | None):
    config = AutoConfig.from_pretrained(assets_dir / "target")
    config._attn_implementation = "sdpa"
    if sliding:  # every other layer slides (layer_types mixes both kinds)
        config.sliding_window = sliding
        config.use_sliding_window = True
        config.max_window_layers = 0
        config.layer_types = ["full_attention", "sliding_attention"] * (config.num_hidden_layers // 2) + [
            "full_attention"
        ] * (config.num_hidden_layers % 2)
    mb = synthetic_micro_batch(ShapeConfig(seq_len=S, num_anchors=4, block_size=8), 125, 0, seed=3)
    masks = packed_masks(config, mb.doc_ids, mb.position_ids, torch.bfloat16)
    assert int(mb.doc_ids.max()) >= 1  # more than one document: tiles off the diagonal are empty
    return list(masks.values()) if isinstance(masks, dict) else [masks]


@pytest.mark.parametrize("sliding", [None, 100], ids=["full", "sliding"])
def test_the_block_mask_visits_what_the_mask_keeps_and_reads_it_where_it_cuts(assets_dir, sliding):
    masks = _masks(assets_dir, sliding)
    assert len(masks) == (2 if sliding else 1)
    for mask in masks:
        dense = mask[0, 0]
        touched, full = tile_masks(dense)
        n = S // TILE
        for i in range(n):  # against the tiles one by one
            for j in range(n):
                tile = dense[i * TILE : (i + 1) * TILE, j * TILE : (j + 1) * TILE]
                assert bool(touched[i, j]) == bool(tile.any()) and bool(full[i, j]) == bool(tile.all())
        block = block_mask_of(mask)
        visited = block.to_dense()[0, 0].bool()
        assert torch.equal(visited, touched)
        assert not bool(touched.all())  # causal and per document: the flex path skips tiles
        full_tiles = torch.zeros_like(touched)
        for i in range(n):
            for j in block.full_kv_indices[0, 0, i, : int(block.full_kv_num_blocks[0, 0, i])].tolist():
                full_tiles[i, j] = True
        assert torch.equal(full_tiles, full)
        q, kv = torch.meshgrid(torch.arange(S), torch.arange(S), indexing="ij")
        assert torch.equal(block.mask_mod(0, 0, q, kv), dense)


def test_a_masks_block_mask_is_built_once_per_forward(assets_dir):
    """BlockMasks (one forward's): the same mask gets the same BlockMask, which visits what
    block_mask_of's does; another mask its own; a mask flex cannot read (additive, not whole
    tiles) none."""
    full, sliding = _masks(assets_dir, 100)
    masks = BlockMasks()
    first = masks.of(full)
    assert masks.of(full) is first and len(masks) == 1
    assert torch.equal(first.to_dense(), block_mask_of(full).to_dense())
    assert masks.of(sliding) is not first and len(masks) == 2
    q, kv = torch.meshgrid(torch.arange(S), torch.arange(S), indexing="ij")
    assert torch.equal(masks.of(sliding).mask_mod(0, 0, q, kv), sliding[0, 0])  # reads its own mask
    assert masks.of(full.float()) is None
    assert masks.of(full[..., 1:, 1:]) is None
    assert masks.of(None) is None and len(masks) == 2


class _Attention(torch.nn.Module):
    sinks = None


def test_calls_flex_cannot_answer_as_sdpa_go_to_sdpa():
    module = _Attention()
    q, k = torch.zeros(1, 4, S, 16), torch.zeros(1, 2, S, 16)
    mask = torch.ones(1, 1, S, S, dtype=torch.bool)
    assert takes_flex(module, q, k, mask, 0.0, {})
    assert not takes_flex(module, q, k, mask.float(), 0.0, {})  # an additive mask
    assert not takes_flex(module, q, k, mask, 0.1, {})
    assert not takes_flex(module, q, k, mask, 0.0, {"softcap": 50.0})
    assert not takes_flex(module, q, k, mask, 0.0, {"s_aux": torch.zeros(4)})
    short = torch.ones(1, 1, S - 1, S - 1, dtype=torch.bool)
    assert not takes_flex(module, q[:, :, 1:], k[:, :, 1:], short, 0.0, {})  # not whole tiles
    assert not takes_flex(module, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), mask, 0.0, {})
    module.sinks = torch.zeros(4)
    assert not takes_flex(module, q, k, mask, 0.0, {})


def test_outside_a_compiled_trace_it_is_sdpa_and_installing_it_is_idempotent():
    from transformers import AttentionInterface

    before = AttentionInterface._global_mapping["sdpa"]
    try:
        use_packed_attention()
        installed = AttentionInterface._global_mapping["sdpa"]
        use_packed_attention()
        assert AttentionInterface._global_mapping["sdpa"] is installed is not before
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, S, 16, generator=g) for h in (4, 2, 2))
        mask = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None]
        module = _Attention()
        module.num_key_value_groups = 2
        ours, _ = installed(module, q, k, v, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert torch.equal(ours, theirs)
        # a BlockMask handed in is the flex path's alone: SDPA never sees it (transformers' own
        # function would ignore it, so a stand-in in front of it says what it was given)
        given = []

        def sdpa(*args, **kwargs):
            given.append(set(kwargs))
            return sdpa_attention_forward(*args, **kwargs)

        handed, _ = packed_attention(sdpa)(module, q, k, v, mask, scaling=0.25, **{BLOCK_MASK: block_mask_of(mask)})
        assert torch.equal(handed, theirs) and given == [{"dropout", "scaling"}]
    finally:
        use_packed_attention(False)
    assert AttentionInterface._global_mapping["sdpa"] is before
