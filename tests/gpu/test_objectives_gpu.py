"""The objectives on CUDA: the Triton distillation chunk against the eager one in bf16 at the
real vocabulary, the objective step recorded as a CUDA graph replaying the eager step bit for
bit (the engine keeps a graph only then) for a D-PACE mix and for DSpark (the FP8 objective step:
test_objectives_fp8_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_triton_distill_chunk_matches_eager_on_cuda():
    from tests.distill_check import compare

    diff = compare("cuda:0", rows=1024, hidden=4096, vocab=151936, dtype=torch.bfloat16)
    assert max(diff["terms_rel"]) < 1e-3 and diff["grad_rel"] < 1e-2, diff  # bf16 logits and gradient
    assert diff["hit_mismatches"] == 0 and diff["forward_only_same"], diff


@pytest.mark.parametrize(
    ("recipe", "layout"),
    [("dflash", "fill_in"), ("dspark", "fill_in"), ("dflash", "anchor_first"), ("dspark", "anchor_first")],
)
def test_recorded_objective_step_replays_the_eager_step(recipe, layout):
    import numpy as np

    from dflash_core.config import ShapeConfig
    from dflash_core.drafter import FrozenHead
    from dflash_core.engine.config import StepPlan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep
    from dflash_core.engine.step_graph import StepGraph, matches_eager
    from dflash_core.step.objectives import objective_of
    from tests.helpers import random_micro_batch, tiny_drafter_config

    block = 4
    cfg = tiny_drafter_config(vocab_size=512, block_size=block, hidden=128, heads=4, kv_heads=2)
    cfg = replace(cfg, layout=layout)
    if recipe == "dspark":
        cfg = replace(cfg, recipe="dspark", markov_rank=16)
    shape = ShapeConfig(seq_len=256, num_anchors=32, block_size=block)
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(torch.randn(512, 128, generator=g) * 0.05, torch.randn(512, 128, generator=g) * 0.05)
    plan = StepPlan(attention="flex", compiled=True, loss="triton", working_weights="bf16")
    rep = DrafterReplica(0, cfg, "cuda:0", head, plan, ReplicaStep(2.0, 48, teacher=True))
    rep.init_weights(0)
    mix = {"ce": 0.1, "tv": 0.9, "conf": 1.0} if recipe == "dspark" else {"ce": 0.3, "kl": 0.4, "tv": 0.5}
    rep.objective.set(objective_of(mix, "decay" if recipe == "dspark" else "dpace", 0.5))
    width = (cfg.num_target_features + 1) * cfg.hidden_size
    batches = [random_micro_batch(np.random.default_rng(s), shape, vocab=512, n_docs=3).to("cuda:0") for s in (1, 2)]
    feats = [torch.randn(256, width, generator=g).to("cuda:0", torch.bfloat16) for _ in range(2)]
    acc = rep.new_accumulator()
    rep.forward_backward(batches[0], feats[0], 1.0, acc, graphed=False)  # compiles outside the graph
    rep.zero_grad()
    graph = StepGraph(rep, batches[0], feats[0])
    assert matches_eager(graph, rep, batches[1], feats[1])
