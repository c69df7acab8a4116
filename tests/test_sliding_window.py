"""Sliding-window drafts: the training mask against a dense windowed mask read element by element
from SpecForge's sliding DFlash mask rule, the closed-form BlockMask against flex's own
create_block_mask, the training forward of a block against its inference forward, and the
checkpoint's `sliding_window` / `layer_types`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.checkpoint import config_from_hf, hf_config
from dflash_core.config import ShapeConfig
from dflash_core.drafter import FrozenHead
from dflash_core.step.attention import dense_mask, dflash_block_mask, dflash_mask_mod, training_attention
from dflash_core.step.micro_step import drafter_forward, inference_block_forward
from tests.helpers import (
    assets_job,
    build_engine,
    random_drafter,
    random_micro_batch,
    small_engine_config,
    tiny_drafter_config,
)


def windowed_mask(doc_ids, anchors, valid, seq_len, block_size, window):
    """Element by element: query at offset o of block j (anchor a) sees context p iff valid, same
    document, p < a and p >= a + o - (window - 1); and its own block's offsets <= o."""
    n = len(anchors)
    m = np.zeros((n * block_size, seq_len + n * block_size), dtype=bool)
    for q in range(n * block_size):
        j, o = divmod(q, block_size)
        a = anchors[j]
        for p in range(seq_len):
            m[q, p] = bool(valid[j]) and doc_ids[p] == doc_ids[a] and a + o - (window - 1) <= p < a
        for k in range(o + 1):
            m[q, seq_len + j * block_size + k] = True
    return m


@pytest.mark.parametrize("seed", range(6))
def test_windowed_mask_matches_the_dense_windowed_rule(seed):
    rng = np.random.default_rng(seed)
    block, window = [4, 5, 8][seed % 3], [5, 8, 13][seed % 3]
    shape = ShapeConfig(seq_len=60, num_anchors=7, block_size=block)
    mb = random_micro_batch(rng, shape, n_docs=1 + seed % 3)
    mod = dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, 60, block, sliding_window=window)
    got = dense_mask(mod, shape.num_query_tokens, shape.kv_len, "cpu").numpy()
    want = windowed_mask(mb.doc_ids.numpy(), mb.anchors.numpy(), mb.anchor_valid.numpy(), 60, block, window)
    assert (got == want).all()
    assert (
        got[:, :60].sum()
        < dense_mask(
            dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, 60, block),
            shape.num_query_tokens,
            shape.kv_len,
            "cpu",
        )[:, :60]
        .sum()
        .item()
    )  # the window cut something


@pytest.mark.parametrize("seed", range(6))
def test_windowed_block_mask_equals_create_block_mask(seed):
    from torch.nn.attention.flex_attention import create_block_mask

    rng = np.random.default_rng(seed)
    block, seq_len, anchors = [4, 8, 16][seed % 3], [200, 256, 130][seed % 3], [16, 24, 40][seed % 3]
    window = [40, 64, 100][seed % 3]
    mb = random_micro_batch(
        rng, ShapeConfig(seq_len=seq_len, num_anchors=anchors, block_size=block), n_docs=1 + seed % 2
    )
    mod = dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block, sliding_window=window)
    ours = dflash_block_mask(
        mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block, mod, tile=32, sliding_window=window
    )
    ref = create_block_mask(mod, None, None, anchors * block, seq_len + anchors * block, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_windowed_training_block_equals_inference_block():
    """A windowed drafter's training forward of every valid block equals its inference forward
    given the whole past of the anchor's document (the window does the cutting)."""
    block, window, seq_len = 4, 6, 80
    cfg = replace(tiny_drafter_config(block_size=block), sliding_window=window)
    drafter = random_drafter(cfg, seed=2).double()
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(
        torch.randn(64, cfg.hidden_size, generator=g).double(), torch.randn(64, cfg.hidden_size, generator=g).double()
    )
    mb = random_micro_batch(
        np.random.default_rng(3), ShapeConfig(seq_len=seq_len, num_anchors=8, block_size=block), n_docs=2
    )
    feats = torch.randn(seq_len, 2 * cfg.hidden_size, generator=g).double()
    attend = training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block, sliding_window=window)
    with torch.no_grad():
        train = drafter_forward(drafter, head, mb, feats, attend).view(-1, block, cfg.hidden_size)
    starts: dict[int, int] = {}
    for p, d in enumerate(mb.doc_ids.tolist()):
        starts.setdefault(d, p)
    checked = 0
    for j, (a, ok) in enumerate(zip(mb.anchors.tolist(), mb.anchor_valid.tolist())):
        if not ok:
            continue
        s = starts[mb.doc_ids[a].item()]
        ids = torch.full((block,), cfg.mask_token_id)
        ids[0] = mb.input_ids[a]
        with torch.no_grad():
            h = inference_block_forward(drafter, head, feats[s:a], ids, a - s)
        assert (h - train[j]).abs().max() < 1e-9, j
        checked += 1
    assert checked >= 3
    # and the window matters: the full-attention drafter computes something else
    full = replace(cfg, sliding_window=None)
    other = random_drafter(full, seed=2).double()
    a = next(
        a
        for a, ok in zip(mb.anchors.tolist(), mb.anchor_valid.tolist())
        if ok and a - starts[mb.doc_ids[a].item()] > window
    )
    s = starts[mb.doc_ids[a].item()]
    ids = torch.full((block,), cfg.mask_token_id)
    ids[0] = mb.input_ids[a]
    with torch.no_grad():
        assert (
            inference_block_forward(other, head, feats[s:a], ids, a - s)
            - inference_block_forward(drafter, head, feats[s:a], ids, a - s)
        ).abs().max() > 1e-6


def test_checkpoint_config_exports_the_window():
    cfg = replace(tiny_drafter_config(block_size=4), sliding_window=2048)
    d = hf_config(cfg, torch.float32)
    assert d["sliding_window"] == 2048 and d["use_sliding_window"] is True
    assert d["dflash_config"]["use_swa"] is True  # vLLM's switch (docs/design.md, the serving contract)
    assert d["layer_types"] == ["sliding_attention"] * cfg.num_hidden_layers
    assert config_from_hf(d) == cfg
    plain = hf_config(tiny_drafter_config(block_size=4), torch.float32)
    assert plain["sliding_window"] is None and config_from_hf(plain).sliding_window is None
    with pytest.raises(ValueError):
        replace(cfg, sliding_window=3)  # smaller than the block


@pytest.mark.slow
def test_engine_trains_and_evaluates_a_windowed_drafter(default_assets, tmp_path):
    import json

    engine = build_engine(small_engine_config(drafter_sliding_window=16), default_assets)
    try:
        res = engine.run_job(assets_job(default_assets, tmp_path, 3, eval_prompts=1, eval_new_tokens=12))
        assert res.status == "SUCCEEDED" and res.eval["blocks"] > 0
        config = json.loads((Path(res.final_checkpoint) / "config.json").read_text())
        assert config["sliding_window"] == 16 and set(config["layer_types"]) == {"sliding_attention"}
    finally:
        engine.close()


def test_the_shipped_modeling_file_applies_the_window(tmp_path, monkeypatch):
    """AutoModel (the checkpoint's own modeling file, as serving loads it) computes what our
    inference forward computes for a windowed drafter, on a context longer than the window."""
    from transformers import AutoModel

    from dflash_core.checkpoint import save_checkpoint

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    block, window, ctx_len = 4, 6, 20
    cfg = replace(tiny_drafter_config(block_size=block), sliding_window=window)
    drafter = random_drafter(cfg, seed=4).float()
    model = AutoModel.from_pretrained(
        str(save_checkpoint(tmp_path / "ck", drafter)), trust_remote_code=True, dtype=torch.float32
    )
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, block, cfg.hidden_size, generator=g)
    feats = torch.randn(1, ctx_len, cfg.num_target_features * cfg.hidden_size, generator=g)
    positions = torch.arange(ctx_len + block).unsqueeze(0)
    from dflash_core.step.attention import DenseAttention, inference_mask

    mask = inference_mask(ctx_len, block, window, "cpu")
    with torch.no_grad():
        theirs = model(noise_embedding=noise, target_hidden=feats, position_ids=positions)[0]
        ours = drafter(
            noise, feats, torch.arange(ctx_len, ctx_len + block), torch.arange(ctx_len), DenseAttention(mask)
        )
    assert (theirs - ours[0]).abs().max() <= 1e-5 * max(1.0, float(ours.abs().max()))
    full = AutoModel.from_pretrained(
        str(save_checkpoint(tmp_path / "full", random_drafter(replace(cfg, sliding_window=None), seed=4).float())),
        trust_remote_code=True,
        dtype=torch.float32,
    )
    with torch.no_grad():
        assert (full(noise_embedding=noise, target_hidden=feats, position_ids=positions)[0] - theirs).abs().max() > 1e-4
