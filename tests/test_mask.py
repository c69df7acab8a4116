"""The training mask equals a brute-force reading of its rule (docs/design.md), for random packings."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core.config import ShapeConfig
from dflash_core.data.batches import make_micro_batch
from dflash_core.data.packing import pack_documents
from dflash_core.drafter import FrozenHead
from dflash_core.step.attention import dense_mask, dflash_mask_mod, training_attention
from dflash_core.step.blocks import block_labels
from dflash_core.step.micro_step import drafter_forward
from tests.helpers import random_documents, random_drafter, random_micro_batch, tiny_drafter_config


def brute_force_mask(doc_ids, anchors, valid, seq_len, block_size):
    n = len(anchors)
    q_len, kv_len = n * block_size, seq_len + n * block_size
    m = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        j = q // block_size
        a = anchors[j]
        for p in range(seq_len):
            if valid[j] and doc_ids[p] == doc_ids[a] and p < a:
                m[q, p] = True
        for p in range(seq_len + j * block_size, seq_len + (j + 1) * block_size):
            m[q, p] = True
    return m


packings = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(8, 40),  # seq_len
    st.integers(1, 6),  # anchors
    st.integers(2, 5),  # block size
    st.integers(1, 5),  # documents
)


@settings(max_examples=60, deadline=None)
@given(packings)
def test_dense_mask_matches_brute_force(params):
    seed, seq_len, n_anchors, block, n_docs = params
    rng = np.random.default_rng(seed)
    shape = ShapeConfig(seq_len=seq_len, num_anchors=n_anchors, block_size=block)
    docs = random_documents(rng, n_docs, min_len=2, max_len=seq_len)
    seqs = pack_documents(docs, seq_len, pad_token_id=0)
    if not seqs:
        return
    mb = make_micro_batch(seqs[0], shape, rng, 0)
    mod = dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block)
    got = dense_mask(mod, shape.num_query_tokens, shape.kv_len, "cpu").numpy()
    want = brute_force_mask(mb.doc_ids.numpy(), mb.anchors.numpy(), mb.anchor_valid.numpy(), seq_len, block)
    assert (got == want).all()
    # Anchors are valid per the rules: loss-masked, followed by a loss-masked token of the same doc.
    for a, ok in zip(mb.anchors.numpy(), mb.anchor_valid.numpy()):
        if ok:
            assert mb.loss_mask[a] and mb.loss_mask[a + 1] and mb.doc_ids[a] == mb.doc_ids[a + 1]
    assert (np.diff(mb.anchors.numpy()[mb.anchor_valid.numpy()]) > 0).all()


def test_mask_is_strict_at_the_anchor():
    doc_ids = torch.zeros(10, dtype=torch.long)
    anchors = torch.tensor([5])
    mod = dflash_mask_mod(doc_ids, anchors, torch.tensor([True]), 10, 3)
    m = dense_mask(mod, 3, 13, "cpu")
    assert m[:, :5].all() and not m[:, 5:10].any() and m[:, 10:].all()


def test_padding_blocks_are_finite_and_weightless():
    rng = np.random.default_rng(0)
    shape = ShapeConfig(seq_len=24, num_anchors=12, block_size=4)
    docs = random_documents(rng, 1, min_len=6, max_len=6, p_loss=1.0)  # 5 valid anchors < 12 slots
    mb = make_micro_batch(pack_documents(docs, 24, 0)[0], shape, rng, 0)
    assert (~mb.anchor_valid).sum() > 0
    cfg = tiny_drafter_config(block_size=4)
    drafter = random_drafter(cfg)
    head = FrozenHead(
        torch.randn(64, cfg.hidden_size, dtype=torch.float64), torch.randn(64, cfg.hidden_size, dtype=torch.float64)
    )
    feats = torch.randn(24, 2 * cfg.hidden_size, dtype=torch.float64)
    attend = training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, 24, 4)
    out = drafter_forward(drafter, head, mb, feats, attend)
    assert torch.isfinite(out).all()
    _, weights = block_labels(mb, 4, gamma=4.0)
    pad_rows = (~mb.anchor_valid).repeat_interleave(4)
    assert (weights[pad_rows] == 0).all()


def test_micro_batch_refuses_a_document_split_into_two_runs():
    """The mask reads "same document" as "same contiguous run": a sequence that breaks that is
    refused when the micro-batch is made, not trained with a wrong mask."""
    from dflash_core.data.batches import make_micro_batch
    from dflash_core.data.packing import PackedSequence

    doc = np.array([0, 0, 0, 1, 1, 0, 0, 0, -1, -1], dtype=np.int64)
    seq = PackedSequence(np.arange(10, dtype=np.int64), doc, np.arange(10, dtype=np.int64), np.ones(10, dtype=bool))
    shape = ShapeConfig(seq_len=10, num_anchors=2, block_size=2)
    with pytest.raises(ValueError, match="more than one run"):
        make_micro_batch(seq, shape, np.random.default_rng(0), 0)
    doc[5:8] = 2  # three contiguous documents then padding: accepted
    assert make_micro_batch(seq, shape, np.random.default_rng(0), 0).anchor_valid.any()


@pytest.mark.parametrize("seed", range(12))
def test_closed_form_block_mask_equals_create_block_mask(seed):
    """The engine's BlockMask (dflash_block_mask: tiles from the intervals) against flex's own
    create_block_mask evaluating the mask_mod on every element: the same needed tiles, the same
    full tiles, the same dense mask, for block sizes that do and do not divide the tile, contexts
    that end mid-tile, and padding blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_core.step.attention import dflash_block_mask

    rng = np.random.default_rng(seed)
    block, seq_len, anchors = [4, 8, 16, 10][seed % 4], [96, 200, 256, 384, 130][seed % 5], [8, 16, 24, 40][seed % 4]
    mb = random_micro_batch(
        rng, ShapeConfig(seq_len=seq_len, num_anchors=anchors, block_size=block), n_docs=1 + seed % 4
    )
    mod = dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block)
    ours = dflash_block_mask(mb.doc_ids, mb.anchors, mb.anchor_valid, seq_len, block, mod, tile=32)
    ref = create_block_mask(mod, None, None, anchors * block, seq_len + anchors * block, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())
