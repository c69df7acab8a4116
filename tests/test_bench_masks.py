"""The element-wise form of the DFlash mask that bench/flex_sweep.py times as its baseline
is the same function as the production (interval) mask_mod on packed micro-batches, also split
into query batch entries."""

import numpy as np
import pytest
import torch

from bench.flex_sweep import gather_mask_mod
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.step.attention import dense_mask, dflash_mask_mod
from tests.helpers import random_micro_batch


def _both(mb, shape, per=0):
    args = (mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, shape.block_size, per)
    q_len, kv_len = (per or shape.num_query_tokens), shape.kv_len
    out = []
    for make in (dflash_mask_mod, gather_mask_mod):
        mod = make(*args)
        # every batch entry of a split: entry b holds queries b * per .. (b + 1) * per
        entries = max(1, shape.num_query_tokens // per) if per else 1
        q_idx = torch.arange(q_len).view(1, -1, 1)
        kv_idx = torch.arange(kv_len).view(1, 1, -1)
        b = torch.arange(entries).view(-1, 1, 1)
        out.append(mod(b, torch.zeros((), dtype=torch.long), q_idx, kv_idx).expand(entries, q_len, kv_len))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_gather_mask_equals_production_mask(seed):
    rng = np.random.default_rng(seed)
    shape = ShapeConfig(seq_len=int(rng.integers(24, 200)), num_anchors=int(rng.integers(2, 24)), block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=int(rng.integers(1, 7)))
    prod, gather = _both(mb, shape)
    assert torch.equal(prod, gather)


def test_gather_mask_equals_production_mask_split_into_entries():
    rng = np.random.default_rng(3)
    shape = ShapeConfig(seq_len=96, num_anchors=16, block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=3)
    prod, gather = _both(mb, shape, per=16)
    assert torch.equal(prod, gather) and prod.any()
    whole = dense_mask(dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, 96, 4), 64, shape.kv_len, "cpu")
    assert torch.equal(prod.reshape(64, -1), whole)


def test_gather_mask_equals_production_mask_on_the_benchmark_batch():
    shape = ShapeConfig(seq_len=3072, num_anchors=64, block_size=16)
    mb = synthetic_micro_batch(shape, 1000, 0)
    prod, gather = _both(mb, shape)
    assert torch.equal(prod, gather) and prod.any()
