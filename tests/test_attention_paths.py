"""flex_attention (BlockMask) and SDPA (dense mask) compute the same function on CPU."""
import numpy as np
import pytest
import torch

from dflash_core.attention import training_attention
from dflash_core.config import ShapeConfig
from dflash_core.train_step import FrozenHead, drafter_forward
from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_equals_sdpa_forward(compiled):
    rng = np.random.default_rng(1)
    shape = ShapeConfig(seq_len=160, num_anchors=12, block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=6)
    cfg = tiny_drafter_config(block_size=4)
    drafter = random_drafter(cfg).float()
    torch.manual_seed(0)
    head = FrozenHead(torch.randn(64, cfg.hidden_size), torch.randn(64, cfg.hidden_size))
    feats = torch.randn(shape.seq_len, 2 * cfg.hidden_size)
    with torch.no_grad():
        dense = drafter_forward(drafter, head, mb, feats, training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, 4))
        flex = drafter_forward(drafter, head, mb, feats, training_attention("flex", mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, 4, compiled=compiled))
    rel = (flex - dense).norm() / dense.norm()
    assert rel < 1e-5, rel
