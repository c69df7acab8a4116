"""The objectives (dflash_core/step/objectives.py): each loss and mix against a dense float64
reference (values and gradients), D-PACE weights against the public definition (SpecForge
`_dpace_weight`, loss_type "dpace"), the whole objective micro-step against a dense reference,
the Triton chunk against the eager one (interpreted on CPU), and the job field's parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core.config import ShapeConfig
from dflash_core.drafter import FrozenHead
from dflash_core.engine.api import JobError
from dflash_core.engine.config import TrainJob
from dflash_core.engine.objective import check_objective
from dflash_core.step.blocks import block_labels
from dflash_core.step.micro_step import StepSettings, micro_step
from dflash_core.step.objectives import (
    ObjectiveInputs,
    chunked_objective_terms,
    dpace_weight,
    objective_of,
    parse_loss,
    reference_objective,
    weighted_objective_loss,
)
from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config

MIXES = {
    "ce": (1.0, 0.0, 0.0),
    "kl": (0.0, 1.0, 0.0),
    "tv": (0.0, 0.0, 1.0),
    "ce+tv": (0.1, 0.0, 0.9),
    "all": (0.2, 0.5, 0.7),
}


def _rows(seed=0, rows=14, hidden=16, vocab=300):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    ht = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    ht[:2] = h[:2]  # a teacher equal to the drafter: kl = tv = 0 and TV's sign is 0 everywhere
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(rows, generator=g, dtype=torch.float64)
    weights[3] = 0.0
    return h, ht, w, labels, weights


@pytest.mark.parametrize("name", list(MIXES))
def test_each_loss_matches_the_dense_reference(name):
    mix = MIXES[name]
    h, ht, w, labels, weights = _rows()
    h1 = h.clone().requires_grad_()
    mixed, terms, _ = chunked_objective_terms(h1, ht, w, labels, torch.tensor(mix, dtype=torch.float64), chunk_size=5)
    loss = weighted_objective_loss(mixed, weights)
    (grad,) = torch.autograd.grad(loss, h1)
    h2 = h.clone().requires_grad_()
    ref = reference_objective(h2, ht, w, labels, weights, mix)
    (ref_grad,) = torch.autograd.grad(ref, h2)
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-6 * max(1.0, abs(float(ref.detach())))
    assert float((grad - ref_grad).abs().max()) <= 1e-6 * float(ref_grad.abs().max())
    assert float(terms[:2, 1:].abs().max()) < 1e-6  # same distribution: no kl, no tv
    assert bool((terms[:, 2] <= 1.0 + 1e-6).all()) and bool((terms[:, 1:] >= -1e-6).all())


def _dpace_by_definition(prob: np.ndarray, valid: np.ndarray, alpha: float) -> np.ndarray:
    """D-PACE's "dpace" weights written from their definition, one block at a time: the prefix
    product of (1 - alpha) p + alpha over valid positions (invalid ones multiply by 1), and the
    weight of position k is the sum of that prefix over the valid positions j >= k."""
    out = np.zeros_like(prob)
    for n in range(prob.shape[0]):
        prefix, running = np.ones(prob.shape[1]), 1.0
        for k in range(prob.shape[1]):
            if valid[n, k]:
                running *= (1 - alpha) * prob[n, k] + alpha
            prefix[k] = running
        for k in range(prob.shape[1]):
            out[n, k] = sum(prefix[j] for j in range(k, prob.shape[1]) if valid[n, j])
    return out


@pytest.mark.parametrize("alpha", [0.5, 0.0, 0.9])
def test_dpace_weights_follow_the_public_definition(alpha):
    rng = np.random.default_rng(1)
    prob = rng.random((6, 7))
    valid = rng.random((6, 7)) > 0.3
    valid[0] = False
    got = dpace_weight(torch.tensor(prob), torch.tensor(valid), alpha).numpy()
    np.testing.assert_allclose(got, _dpace_by_definition(prob, valid, alpha), rtol=1e-6)
    assert (got[0] == 0).all()


def _objective_setup(block_size=4):
    cfg = tiny_drafter_config(block_size=block_size)
    shape = ShapeConfig(seq_len=48, num_anchors=6, block_size=block_size)
    mb = random_micro_batch(np.random.default_rng(4), shape, n_docs=2)
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(torch.randn(64, cfg.hidden_size, generator=g), torch.randn(64, cfg.hidden_size, generator=g))
    n_feats = cfg.num_target_features * cfg.hidden_size
    feats = torch.randn(48, n_feats + cfg.hidden_size, generator=g)
    return cfg, mb, head, feats


@pytest.mark.parametrize(("name", "dpace"), [("ce", False), ("kl", False), ("tv", True), ("all", True)])
def test_objective_micro_step_matches_a_dense_reference(name, dpace):
    """The objective step's loss and drafter gradients equal a dense float64 reference computed
    from the same drafter hidden states: teacher rows are the target's states at the position
    before each label, block position 0 never counts, weights decayed or D-PACE."""
    cfg, mb, head, feats = _objective_setup()
    drafter = random_drafter(cfg).float()
    inputs = ObjectiveInputs("cpu")
    inputs.set(objective_of(dict(zip(("ce", "kl", "tv"), MIXES[name])), "dpace" if dpace else "decay", 0.5))
    hidden_out = {}
    drafter.norm.register_forward_hook(lambda _m, _i, out: hidden_out.setdefault("h", out))
    res = micro_step(drafter, head, mb, feats, StepSettings("dense", 2.0, 5, objective=inputs).with_hooks(cfg))
    grads = torch.autograd.grad(res.loss, list(drafter.parameters()), retain_graph=True)

    b, n = cfg.block_size, mb.anchors.shape[0]
    hidden = hidden_out["h"][0]  # [N*B, H], the graph's own tensor
    labels, decayed = block_labels(mb, b, 2.0)
    keep = (torch.arange(n * b) % b) != 0
    teacher_pos = (mb.anchors.unsqueeze(1) + torch.arange(b) - 1).clamp(0, 47).reshape(-1)
    teacher = feats[:, cfg.num_target_features * cfg.hidden_size :][teacher_pos]
    ref = reference_objective(
        hidden[keep], teacher[keep], head.lm_head_weight, labels[keep], decayed[keep], MIXES[name], dpace, 0.5, b - 1
    )
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))
    assert abs(float(res.loss.detach()) - float(ref.detach())) <= 1e-5 * max(1.0, abs(float(ref.detach())))
    for got, want in zip(grads, ref_grads, strict=True):
        assert float((got - want).abs().max()) <= 1e-4 * max(1e-8, float(want.abs().max()))
    assert not bool((res.weights[:, 0] > 0).any())


def test_loss_field_parsing_and_engine_checks():
    assert parse_loss("kl") == {"kl": 1.0}
    assert parse_loss({"ce": 0.1, "tv": 0.9}) == {"ce": 0.1, "tv": 0.9}
    for bad in (
        "mse",
        {"ce": -1.0},
        {"ce": 0.0, "tv": 0},
        {},
        {"lk": 1.0},
        {"ce": "1"},
        {"ce": float("nan")},
        {"ce": 10**400},
        {"ce": 1e308},
    ):
        with pytest.raises(ValueError):
            parse_loss(bad)
    job = TrainJob(datasets=["x"], output_dir="y", steps=1, loss={"kl": 1.0})
    with pytest.raises(JobError) as e:
        check_objective(job, teacher=False)
    assert e.value.field == "loss"
    assert check_objective(job, teacher=True).kl == 1.0
    dpace = TrainJob(datasets=["x"], output_dir="y", steps=1, position_weights="dpace")
    with pytest.raises(JobError) as e:
        check_objective(dpace, teacher=False)
    assert e.value.field == "position_weights"
    assert check_objective(TrainJob(datasets=["x"], output_dir="y", steps=1), teacher=False).is_plain_ce


@pytest.mark.interpreted_check("tests.distill_check")
def test_triton_objective_chunk_matches_eager_interpreted(interpreted):
    """kernels/distill.py through Triton's interpreter (tests/gpu runs it on CUDA): ce, kl, tv
    per row, argmax hits and the mixed gradient as the eager chunk, one and several vocabulary
    blocks; so too without TV in the mix (the fused path that skips the pass for sigma) and with
    the teacher as a table indexed per row with its logsumexp formed once (TeacherRows)."""
    result = interpreted("tests.distill_check")
    for case, diff in result.items():
        assert max(diff["terms_rel"]) < 1e-5 and diff["grad_rel"] < 1e-5, (case, diff)
        assert diff["hit_mismatches"] == 0 and diff["hits"] > 0 and diff["forward_only_same"], (case, diff)
        assert diff["same_teacher_zero"] < 1e-6, (case, diff)
        for variant in ("no_tv", "indexed", "indexed_no_tv"):
            v = diff[variant]
            assert max(v["terms_rel"]) < 1e-5 and v["grad_rel"] < 1e-5 and v["hit_mismatches"] == 0, (case, v)
        assert diff["lse_rel"] < 1e-6, (case, diff)
    assert result["several_blocks"]["argmax_blocks"] >= 2


def test_teacher_target_appends_its_final_hidden_states(default_assets):
    """A teacher target's features are the captured layers' outputs (as without the teacher)
    followed by the final-norm hidden states, whose lm_head gives the target's own logits."""
    from dflash_core.defaults import DEFAULT_TARGET_LAYER_IDS
    from dflash_core.target import TargetModel

    ids = list(DEFAULT_TARGET_LAYER_IDS)
    plain = TargetModel(default_assets.target, ids, "cpu")
    teacher = TargetModel(default_assets.target, ids, "cpu", teacher=True)
    tokens = torch.randint(0, 100, (20,), generator=torch.Generator().manual_seed(0))
    pos, doc = torch.arange(20), torch.zeros(20, dtype=torch.long)
    base, both = plain.capture(tokens, pos, doc), teacher.capture(tokens, pos, doc)
    h = teacher.hidden_size
    assert both.shape == (20, (len(ids) + 1) * h)
    assert torch.equal(both[:, :-h], base)
    logits, _ = teacher.forward_logits(tokens)
    head = teacher.frozen_head()
    torch.testing.assert_close(both[:, -h:] @ head.lm_head_weight.t(), logits, rtol=1e-4, atol=1e-4)


def test_objective_step_with_plain_ce_equals_the_block_ce_step():
    """A teacher engine's objective step running the default objective (CE, decayed weights)
    computes the block CE step's loss, hits, weights and gradients."""
    cfg, mb, head, feats = _objective_setup()
    width = cfg.num_target_features * cfg.hidden_size
    results = []
    for objective in (None, ObjectiveInputs("cpu")):
        drafter = random_drafter(cfg).float()
        f = feats if objective is not None else feats[:, :width]
        settings = StepSettings("dense", 2.0, 5, objective=objective)
        res = micro_step(drafter, head, mb, f, settings.with_hooks(cfg) if objective is not None else settings)
        results.append((res, torch.autograd.grad(res.loss, list(drafter.parameters()))))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.correct, b.correct) and torch.equal(a.weights, b.weights)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def test_teacher_logits_per_context_position_equal_the_per_row_ones():
    """More rows than context positions (overlapping blocks): the teacher's logits formed once per
    position and gathered give the terms and gradient of the per-row GEMMs; fewer rows: per row."""
    from dflash_core.step.teacher import TeacherLogits

    g = torch.Generator().manual_seed(3)
    seq, rows, hidden, vocab = 12, 40, 16, 50
    teacher = torch.randn(seq, hidden, generator=g, dtype=torch.float64)
    positions = torch.randint(0, seq, (rows,), generator=g)
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    mix = torch.tensor([0.2, 0.5, 0.7], dtype=torch.float64)
    shared = TeacherLogits.at_positions(teacher, positions, w)
    assert shared.per_position and not TeacherLogits.at_positions(teacher, positions[:seq], w).per_position
    out = {}
    for name, source in (("shared", shared), ("rows", teacher[positions])):
        h1 = h.clone().requires_grad_()
        mixed, terms, hits = chunked_objective_terms(h1, source, w, labels, mix, chunk_size=7)
        (grad,) = torch.autograd.grad(mixed.sum(), h1)
        out[name] = (terms, hits, grad)
    for a, b in zip(out["shared"], out["rows"], strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # the Triton kernel in the (slow) interpreter
@pytest.mark.interpreted_check("tests.distill_check", "--fp8")
def test_fp8_objective_chunk_matches_the_exact_chunk_interpreted(interpreted):
    """The FP8 lm_head distillation chunk (kernels/distill.py chunk_terms_fp8, Triton's
    interpreter; tests/gpu runs the FP8 objective step on CUDA) against the fp32 eager chunk of
    the exact logits, a mix of ce, kl and tv over a vocabulary FP8 pads (2003 -> 2016).

    Tolerances: e4m3 keeps 3 mantissa bits, so h and W are each rounded by up to 1/16, and a
    logit carries a few percent of its spread as error. The FP8 CE chunk's checks
    (tests/test_fp8.py) allow 0.5 % on a weighted loss sum and 6 % on the gradient; the terms here
    are compared row by row (norms over rows, no averaging across rows), so 3 % each. The
    gradient: ce's alone within the CE chunk's 6 %; kl's is p_d - p_t, a difference of two
    rounded distributions that shrinks where they agree, 10 %; tv's is 1/2 p_d (sign(p_d - p_t)
    - sigma), whose sign any rounding flips where the two nearly agree (the bf16 chunk's is
    already several percent off the exact one), so a cosine of 0.85 only; the mix within 12 % and
    at cosine 0.99. Hits: the same but where FP8 reorders near-tied top logits, as the CE check.
    The kernel alone, on the FP8 chunk's own logits, matches the eager terms to fp32 rounding,
    and its FP8 gradient the eager one to e4m3's rounding (3 %), never above the scale's bound.
    A whole objective micro-step with the kernel "triton_fp8" (the teacher's logits per context
    position, chunks that are not a multiple of the rows) within the CE chunk's 0.5 % of the
    "triton" step's loss, not equal to it (its GEMMs ran in FP8), gradients at cosine 0.98 (as
    the FP8 CE step's on CUDA, tests/gpu/test_fp8_gpu.py)."""
    result = interpreted("tests.distill_check", "--fp8")
    step = result["micro_step"]
    assert 0 < step["loss_rel"] < 5e-3 and step["grad_cosine_min"] > 0.98, step
    r = result["chunk"]
    assert r["padded_vocab"] > r["vocab"]
    assert max(r["terms_rel"]) < 0.03 and r["grad_rel"] < 0.12 and r["grad_cosine"] > 0.99, r
    by_term = r["grad_by_term"]
    assert by_term["ce"][0] < 0.06 and by_term["kl"][0] < 0.1 and by_term["tv"][1] > 0.85, by_term
    assert r["hit_mismatches"] <= r["rows"] // 4 and r["hits"] > 0 and r["forward_only_same"], r
    assert max(r["kernel_terms_rel"]) < 1e-5 and r["kernel_grad_rel"] < 0.03, r
    assert 0 < r["kernel_grad_max"] <= r["bound"], r
    # NaN in the padding columns of both logits changes nothing: the softmaxes never read them
    assert r["padding_unread"] and r["padding_grad_zero"], r


def test_fp8_teacher_table_equals_the_per_row_fp8_logits():
    """With an FP8 lm_head the teacher's logits come from one FP8 GEMM of the teacher hidden
    states cast with one scale: the per-position table gathered equals the per-row logits of the
    same rows (the positions cover every context position, so both casts see the same largest
    value), without the padding columns, within FP8's error of the bf16 logits; and a plain
    tensor head gives the bf16 GEMM's logits bit for bit, as before FP8 heads existed."""
    from dflash_core.fp8 import quantize_head
    from dflash_core.step.teacher import TeacherLogits

    g = torch.Generator().manual_seed(5)
    seq, hidden, vocab = 32, 64, 1003
    teacher = (torch.randn(seq, hidden, generator=g) * 3).bfloat16()
    positions = torch.cat([torch.randperm(seq, generator=g), torch.randint(0, seq, (48,), generator=g)])
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    head = quantize_head(w)
    table = TeacherLogits.at_positions(teacher, positions, head)
    rows = TeacherLogits.of_rows(teacher[positions], head)
    assert table.per_position and not rows.per_position
    exact = teacher[positions].float() @ w.float().t()
    for start, end in ((0, 16), (16, 48), (48, 80)):
        a, b = table.chunk(start, end), rows.chunk(start, end)
        assert a.shape == (end - start, vocab) and a.dtype == torch.bfloat16
        assert torch.equal(a, b), (start, end)
        assert float((a.float() - exact[start:end]).norm() / exact[start:end].norm()) < 0.06
    table.release()
    assert table._table is None and table._fp8 is None
    plain = TeacherLogits.at_positions(teacher, positions, w)
    assert torch.equal(plain.chunk(16, 48), (teacher @ w.t()).index_select(0, positions[16:48]))
    assert torch.equal(TeacherLogits.of_rows(teacher[positions], w).chunk(16, 48), teacher[positions][16:48] @ w.t())
