"""The interval form of the DFlash mask that bench/flex_sweep.py times is the same function as
the production mask_mod on packed micro-batches (documents are contiguous after packing)."""
import numpy as np
import pytest
import torch

from bench.flex_sweep import context_intervals, interval_mask_mod
from dflash_core.attention import dense_mask, dflash_mask_mod
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from tests.helpers import random_micro_batch


def _both(mb, shape):
    q_len, kv_len = shape.num_query_tokens, shape.kv_len
    prod = dense_mask(dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, shape.block_size),
                      q_len, kv_len, "cpu")
    lo, hi = context_intervals(mb)
    interval = dense_mask(interval_mask_mod(lo, hi, shape.seq_len, shape.block_size), q_len, kv_len, "cpu")
    return prod, interval


@pytest.mark.parametrize("seed", range(8))
def test_interval_mask_equals_production_mask(seed):
    rng = np.random.default_rng(seed)
    shape = ShapeConfig(seq_len=int(rng.integers(24, 200)), num_anchors=int(rng.integers(2, 24)), block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=int(rng.integers(1, 7)))
    prod, interval = _both(mb, shape)
    assert torch.equal(prod, interval)


def test_interval_mask_equals_production_mask_on_the_benchmark_batch():
    shape = ShapeConfig(seq_len=3072, num_anchors=64, block_size=16)
    mb = synthetic_micro_batch(shape, 1000, 0)
    prod, interval = _both(mb, shape)
    assert torch.equal(prod, interval) and prod.any()
