"""The FP8 objective step (its lm_head GEMMs in FP8, the teacher's too) against the bf16 one,
and its recorded CUDA graph. In a process of its own (`make test-gpu` runs each file in one):
after the other objective steps' compiles of that process, the FP8 step's mask function
recompiles inside its graph capture, which no engine does (an engine compiles one plan and runs
it eagerly before it records)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 matmuls"
)
def test_fp8_objective_step_matches_the_bf16_one_and_replays_as_a_graph():
    """precision fp8 with the teacher: the objective step's lm_head GEMMs (the drafter's logits,
    grad_h, the teacher's logits) in FP8 over a vocabulary FP8 pads (32003 -> 32016), for a
    D-PACE mix with the teacher's logits per row (960 rows, 1024 context positions) and per
    context position (1920 rows), and for DSpark (the Markov bias and its gradients in bf16):
    the loss within 2 % of the bf16 step's, every parameter gradient at cosine >= 0.97 to bf16's
    (as the FP8 CE step's 0.98, less for tv's gradient, a sign of p_d - p_t that FP8's rounding
    flips where the two nearly agree), chunks of 256 rows that do not divide the rows; the fp8
    step's graph replays its eager step bit for bit.

    One test, every bf16 step before any fp8 one: compiled functions are process-wide, and bf16
    steps compiled after FP8 ones in the same process fail in their compiled layer (Makefile,
    test-gpu)."""
    import numpy as np

    from dflash_core.config import ShapeConfig
    from dflash_core.drafter import FrozenHead
    from dflash_core.engine.config import step_plan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep
    from dflash_core.engine.step_graph import StepGraph, matches_eager
    from dflash_core.step.objectives import objective_of
    from tests.helpers import random_micro_batch, tiny_drafter_config

    vocab, hidden, block, seq = 32003, 512, 16, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(vocab, hidden, device="cuda", generator=g),
        torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05,
    )
    base = tiny_drafter_config(vocab_size=vocab, block_size=block, hidden=hidden, heads=4, kv_heads=2, layers=2)
    cases = {  # name: (drafter config, anchors, mix, position weights)
        "dflash_rows": (base, 64, {"ce": 0.3, "kl": 0.4, "tv": 0.5}, "dpace"),
        "dflash_table": (base, 128, {"ce": 0.3, "kl": 0.4, "tv": 0.5}, "dpace"),
        "dspark_table": (
            replace(base, recipe="dspark", markov_rank=16),
            128,
            {"ce": 0.1, "tv": 0.9, "conf": 1.0},
            "decay",
        ),
    }
    width = (base.num_target_features + 1) * hidden
    inputs = {}
    for name, (_, anchors, _, _) in cases.items():
        shape = ShapeConfig(seq_len=seq, num_anchors=anchors, block_size=block)
        batches = [
            random_micro_batch(np.random.default_rng(s), shape, vocab=vocab, n_docs=3).to("cuda:0") for s in (1, 2)
        ]
        feats = [torch.randn(seq, width, device="cuda", generator=g).bfloat16() for _ in range(2)]
        inputs[name] = (batches, feats)

    def eager_step(name: str, precision: str):
        """(loss, gradients, replica); the step's autograd graph is dropped on return: a graph
        recorded later must create its own gradient accumulators on its capture stream."""
        cfg, _, mix, weights = cases[name]
        plan = step_plan(["cuda:0"], precision=precision)
        rep = DrafterReplica(0, cfg, "cuda:0", head, plan, ReplicaStep(4.0, 256, teacher=True))
        rep.init_weights(3)
        rep.objective.set(objective_of(mix, weights, 0.5))
        (batch, _), (feats, _) = inputs[name]
        res, _ = rep.loss_and_backward(batch, feats, 1.0)
        out = (float(res.loss.detach()), [p.grad.clone() for p in rep.params], rep)
        rep.zero_grad()
        return out

    bf16 = {name: eager_step(name, "bf16")[:2] for name in cases}
    for name in cases:
        loss8, grads8, rep8 = eager_step(name, "fp8")
        assert rep8.plan.loss == "triton_fp8" and rep8.head.lm_head_fp8 is not None
        loss16, grads16 = bf16[name]
        assert abs(loss8 - loss16) <= 0.02 * abs(loss16), (name, loss8, loss16)
        cosines = {n: _cosine(a, b) for (n, _), a, b in zip(rep8.drafter.named_parameters(), grads8, grads16)}
        assert min(cosines.values()) >= 0.97, (name, cosines)
        (batch, other), (feats, other_feats) = inputs[name]
        graph = StepGraph(rep8, batch, feats)
        assert matches_eager(graph, rep8, other, other_feats), name
