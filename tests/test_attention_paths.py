"""flex_attention (BlockMask) and SDPA (dense mask) compute the same function on CPU."""

import numpy as np
import pytest
import torch

from dflash_core.config import ShapeConfig
from dflash_core.drafter import FrozenHead
from dflash_core.step.attention import training_attention
from dflash_core.step.micro_step import drafter_forward
from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config

# one xdist worker for the module: its compiled tests share what inductor built in the process
# (the drafter layer's graphs, the loss chunk's), each a CPU compile of many seconds when it is not
# there yet
pytestmark = pytest.mark.xdist_group("test_attention_paths")


def _forward_setup(seed: int, shape: ShapeConfig, n_docs: int):
    """A packed micro-batch, an fp32 tiny drafter, a frozen head and target features."""
    mb = random_micro_batch(np.random.default_rng(seed), shape, n_docs=n_docs)
    cfg = tiny_drafter_config(block_size=shape.block_size)
    drafter = random_drafter(cfg).float()
    torch.manual_seed(0)
    head = FrozenHead(torch.randn(64, cfg.hidden_size), torch.randn(64, cfg.hidden_size))
    return mb, drafter, head, torch.randn(shape.seq_len, 2 * cfg.hidden_size)


# compiled: an inductor C++ compile of flex attention, several seconds on 2 cores
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flex_equals_sdpa_forward(compiled):
    shape = ShapeConfig(seq_len=160, num_anchors=12, block_size=4)
    mb, drafter, head, feats = _forward_setup(1, shape, n_docs=6)
    with torch.no_grad():
        dense = drafter_forward(
            drafter,
            head,
            mb,
            feats,
            training_attention("dense", mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, 4),
        )
        flex = drafter_forward(
            drafter,
            head,
            mb,
            feats,
            training_attention("flex", mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, 4, compiled=compiled),
        )
    rel = (flex - dense).norm() / dense.norm()
    assert rel < 1e-5, rel


@pytest.mark.slow  # compiles a drafter step with inductor on the CPU
@pytest.mark.parametrize("scope", ["layer", "step"])
def test_compiled_step_equals_eager_step(scope):
    """The engine's compiled step ("layer": compiled layers, their backward, compiled loss chunks)
    and the benchmarks' whole-forward variant ("step") compute the same loss and gradients as the
    eager step (CPU, dense attention: flex has no CPU backward)."""
    from bench.variants import variant_kernels
    from dflash_core.engine.config import CPU_PLAN, StepPlan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep

    rng = np.random.default_rng(3)
    shape = ShapeConfig(seq_len=96, num_anchors=8, block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=3)
    cfg = tiny_drafter_config(block_size=4)
    torch.manual_seed(0)
    head = FrozenHead(torch.randn(64, cfg.hidden_size), torch.randn(64, cfg.hidden_size))
    feats = torch.randn(shape.seq_len, 2 * cfg.hidden_size)
    results = []
    compiled_plan = StepPlan(attention="dense", compiled=True, loss="compiled", working_weights="fp32")
    for plan in (CPU_PLAN, compiled_plan):
        rep = DrafterReplica(0, cfg, "cpu", head, plan, ReplicaStep(2.0, 16))
        if plan.compiled and scope != "layer":
            rep.kernels = variant_kernels(rep.drafter, plan, scope)
        rep.drafter.init_weights(0, std=0.2)
        acc = rep.new_accumulator()
        res = rep.forward_backward(mb, feats, 1.0, acc)
        results.append((res.loss.detach(), [p.grad.clone() for p in rep.params]))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-5)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# compiled: an inductor C++ compile of flex attention, several seconds on 2 cores
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flex_with_query_splits_equals_sdpa(compiled):
    """Queries run as batch entries against one broadcast K, V (FlexAttention.q_splits): the same
    function as one entry and as the dense mask."""
    from dflash_core.step.attention import FlexAttention, usable_q_splits

    shape = ShapeConfig(seq_len=200, num_anchors=64, block_size=4)  # Q = 256 = 2 tiles of 128
    assert usable_q_splits(256, 4) == 2 and usable_q_splits(256, 1) == 1 and usable_q_splits(48, 4) == 1
    mb, drafter, head, feats = _forward_setup(2, shape, n_docs=5)
    args = (mb.doc_ids, mb.anchors, mb.anchor_valid, shape.seq_len, 4)
    split = training_attention("flex", *args, compiled=compiled, q_splits=4)
    assert isinstance(split, FlexAttention) and split.q_splits == 2
    with torch.no_grad():
        dense = drafter_forward(drafter, head, mb, feats, training_attention("dense", *args))
        whole = drafter_forward(drafter, head, mb, feats, training_attention("flex", *args, compiled=compiled))
        parts = drafter_forward(drafter, head, mb, feats, split)
    assert (parts - whole).norm() / whole.norm() < 1e-5
    assert (parts - dense).norm() / dense.norm() < 1e-5


def test_split_mask_mod_is_the_mask_reshaped():
    from dflash_core.step.attention import dense_mask, dflash_mask_mod

    rng = np.random.default_rng(5)
    shape = ShapeConfig(seq_len=40, num_anchors=8, block_size=4)
    mb = random_micro_batch(rng, shape, n_docs=3)
    q_len, kv_len = 32, 72
    whole = dense_mask(dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, 40, 4), q_len, kv_len, "cpu")
    split_mod = dflash_mask_mod(mb.doc_ids, mb.anchors, mb.anchor_valid, 40, 4, queries_per_batch=8)
    q = torch.arange(8).view(-1, 1)
    kv = torch.arange(kv_len).view(1, -1)
    zero = torch.zeros((), dtype=torch.long)
    for b in range(4):
        part = split_mod(torch.tensor(b), zero, q, kv)
        assert torch.equal(part, whole[8 * b : 8 * (b + 1)])


@pytest.mark.slow  # an inductor compile of a drafter layer on the CPU (about 20 s with a cold cache)
def test_one_compiled_layer_serves_every_layer():
    """The compiled step: a 5-layer drafter compiles the layer once, the first layer too (its
    input takes a gradient like the others'), not once per layer; the loss chunk adds one graph."""
    from torch._dynamo.utils import counters

    from dflash_core.engine.config import StepPlan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep

    torch._dynamo.reset()
    shape = ShapeConfig(seq_len=96, num_anchors=8, block_size=4)
    mb = random_micro_batch(np.random.default_rng(4), shape, n_docs=3)
    cfg = tiny_drafter_config(block_size=4, layers=5)
    head = FrozenHead(torch.randn(64, cfg.hidden_size), torch.randn(64, cfg.hidden_size))
    feats = torch.randn(shape.seq_len, 2 * cfg.hidden_size)
    before = counters["stats"]["unique_graphs"]
    plan = StepPlan(attention="dense", compiled=True, loss="compiled", working_weights="fp32")
    rep = DrafterReplica(0, cfg, "cpu", head, plan, ReplicaStep(2.0, 16))
    rep.forward_backward(mb, feats, 1.0, rep.new_accumulator())
    assert counters["stats"]["unique_graphs"] - before == 2
