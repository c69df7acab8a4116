"""The Triton distillation chunk (dflash_core/kernels/distill.py) against the eager one
(step/objectives.py): the same ce, kl and tv per row, argmax hits and mixed row gradient. Runs on
CUDA (tests/gpu) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.distill_check` (the flag is read when the kernel module is
imported); `--fp8`: the FP8 lm_head chunk (fp8_compare); `--fp8-dspark`: DSpark's Markov
objective with it (dspark_fp8_compare)."""

from __future__ import annotations

import json
import sys

import torch

from dflash_core.kernels.distill import BLOCK_V, chunk_terms
from dflash_core.step.objectives import chunk_terms_eager


def compare(
    device: str = "cpu", rows: int = 17, hidden: int = 32, vocab: int = 5000, dtype=torch.float32, seed: int = 0
) -> dict:
    """Relative differences of the terms and the gradient for a mix with every term weighted, and
    the argmax disagreements. Some rows' teacher equals the drafter (kl = tv = 0, sign 0).
    Beside it: a mix without TV (the kernel's fused path, no pass for sigma) and the teacher as
    step.teacher.TeacherRows, a table of more rows than the chunk indexed per row with its
    logsumexp formed by row_logsumexp, both against the eager chunk of the gathered rows; and
    row_logsumexp on a view with a row stride against torch.logsumexp. Rows 5, 7, ... answer with
    their argmax: at 17 rows (and vocab 9000, seed 1) those fall in each of the three vocabulary
    blocks."""
    from dflash_core.kernels.distill import row_logsumexp
    from dflash_core.step.teacher import TeacherRows

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.2
    h = torch.randn(rows, hidden, generator=g)
    ht = torch.randn(rows, hidden, generator=g)
    ht[:3] = h[:3]
    labels = torch.randint(0, vocab, (rows,), generator=g)
    right = (h @ w.t()).argmax(-1)
    labels[5::2] = right[5::2]
    mix = torch.tensor([0.3, 0.5, 0.9])
    table = torch.randn(rows + 7, hidden, generator=g)
    index = torch.randint(0, rows + 7, (rows,), generator=g)
    h, ht, w, labels, mix, table, index = (
        h.to(device, dtype),
        ht.to(device, dtype),
        w.to(device, dtype),
        labels.to(device),
        mix.to(device),
        table.to(device, dtype),
        index.to(device),
    )
    zt = ht @ w.t()
    ref_terms, ref_hits, ref_grad = chunk_terms_eager(h, zt, w, labels, mix, True)
    terms, hits, grad = chunk_terms(h, zt, w, labels, mix, True)
    terms_only, hits_only, none = chunk_terms(h, zt, w, labels, mix, False)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    def against_eager(zt_rows, zt_dense, mix_):
        want_terms, want_hits, want_grad = chunk_terms_eager(h, zt_dense, w, labels, mix_, True)
        got_terms, got_hits, got_grad = chunk_terms(h, zt_rows, w, labels, mix_, True)
        return {
            "terms_rel": [rel(got_terms[:, i], want_terms[:, i]) for i in range(3)],
            "grad_rel": rel(got_grad, want_grad),
            "hit_mismatches": int((got_hits != want_hits).sum()),
        }

    no_tv = torch.tensor([0.3, 0.5, 0.0], device=device)
    zt_table = table @ w.t()
    wide = torch.cat([zt_table, torch.zeros_like(zt_table[:, :5])], dim=1)[:, :vocab]  # a row stride
    lse = row_logsumexp(wide)
    indexed = TeacherRows(zt_table, index, lse)
    return {
        "terms_rel": [rel(terms[:, i], ref_terms[:, i]) for i in range(3)],
        "grad_rel": rel(grad, ref_grad),
        "hit_mismatches": int((hits != ref_hits).sum()),
        "hits": int(ref_hits.sum()),
        "argmax_blocks": len(set((right[5::2] // BLOCK_V).tolist())),
        "same_teacher_zero": float(terms[:3, 1:].abs().max()),
        "forward_only_same": bool(torch.allclose(terms_only, terms, rtol=1e-6, atol=1e-7))
        and bool((hits_only == hits).all())
        and none is None,
        "no_tv": against_eager(zt, zt, no_tv),
        "indexed": against_eager(indexed, zt_table[index], mix),
        "indexed_no_tv": against_eager(indexed, zt_table[index], no_tv),
        "lse_rel": rel(lse, torch.logsumexp(zt_table.float(), dim=-1)),
    }


def _norm_rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def fp8_compare(rows: int = 16, hidden: int = 32, vocab: int = 2003, seed: int = 0) -> dict:
    """The FP8 chunk (chunk_terms_fp8: bf16 inputs, an Fp8Head whose vocabulary FP8 pads, the
    teacher's logits from the same head) against the fp32 eager chunk of the exact logits, a mix
    with every term weighted: relative errors (norms over rows) of each term and the gradient,
    hit mismatches. Half the rows' teachers are near the drafter (small kl and tv), the others
    not. Beside that, the kernel alone on the FP8 chunk's own logits (no FP8 rounding between
    them): its terms against the eager ones, its FP8 gradient against theirs; and the same logits
    with NaN in the padding columns give the same terms and gradient bit for bit, zeros in the
    gradient's padding columns (the padding is never read into a softmax). W's scale gives the
    logits the same spread at any width (0.05 at 64)."""
    from dflash_core.fp8 import FORWARD_DTYPE, head_logits, quantize, quantize_head
    from dflash_core.kernels.distill import chunk_terms_fp8, logit_terms_fp8
    from dflash_core.step.objectives import logit_terms_eager
    from dflash_core.step.teacher import TeacherLogits

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * (0.4 / hidden**0.5)
    h = torch.randn(rows, hidden, generator=g) * 4
    ht = torch.randn(rows, hidden, generator=g) * 4
    ht[::2] = h[::2] + torch.randn(rows // 2, hidden, generator=g) * 0.5
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::3] = (h @ w.t()).argmax(-1)[::3]  # some right answers
    mix = torch.tensor([0.3, 0.5, 0.9])
    ref_terms, ref_hits, ref_grad = chunk_terms_eager(h, ht @ w.t(), w, labels, mix, True)
    head = quantize_head(w.bfloat16())
    zt = TeacherLogits.of_rows(ht.bfloat16(), head).chunk(0, rows)
    terms, hits, grad = chunk_terms_fp8(h.bfloat16(), zt, head, labels, mix, True)
    by_term = {}  # each term's gradient alone: (relative error, cosine) against the exact one
    for i, name in enumerate(("ce", "kl", "tv")):
        one = torch.zeros(3)
        one[i] = 1.0
        want = chunk_terms_eager(h, ht @ w.t(), w, labels, one, True)[2]
        got = chunk_terms_fp8(h.bfloat16(), zt, head, labels, one, True)[2]
        by_term[name] = (_norm_rel(got, want), _cosine(got, want))
    terms_only, hits_only, none = chunk_terms_fp8(h.bfloat16(), zt, head, labels, mix, False)

    zd = head_logits(*quantize(h.bfloat16(), FORWARD_DTYPE), head)
    padded = head.rows.shape[0]
    own_terms, _, own_grad = logit_terms_eager(zd.float(), zt.float(), labels, mix, True)
    k_terms, k_hits, grad8, grad_inv = logit_terms_fp8(zd.clone(), zt, labels, mix, True, padded)
    poisoned = []
    for x in (zd, zt):
        full = torch.full((rows, padded), float("nan"), dtype=x.dtype)
        full[:, :vocab] = x
        poisoned.append(full[:, :vocab])
    p_terms, p_hits, p_grad8, _ = logit_terms_fp8(*poisoned, labels, mix, True, padded)
    return {
        "terms_rel": [_norm_rel(terms[:, i], ref_terms[:, i]) for i in range(3)],
        "grad_rel": _norm_rel(grad, ref_grad),
        "grad_cosine": _cosine(grad, ref_grad),
        "grad_by_term": by_term,
        "hit_mismatches": int((hits != ref_hits).sum()),
        "hits": int(ref_hits.sum()),
        "forward_only_same": bool(torch.equal(terms_only, terms))
        and bool(torch.equal(hits_only, hits))
        and none is None,
        "kernel_terms_rel": [_norm_rel(k_terms[:, i], own_terms[:, i]) for i in range(3)],
        "kernel_grad_rel": _norm_rel(grad8[:, :vocab].float() * grad_inv, own_grad),
        "kernel_grad_max": float((grad8.float() * grad_inv).abs().max()),
        "bound": float(mix.abs().sum()),
        "padding_unread": bool(torch.equal(p_terms, k_terms))
        and bool(torch.equal(p_hits, k_hits))
        and bool(torch.equal(p_grad8.view(torch.uint8), grad8.view(torch.uint8))),
        "padding_grad_zero": not bool(grad8[:, vocab:].float().any()),
        "rows": rows,
        "vocab": vocab,
        "padded_vocab": padded,
    }


def dspark_fp8_compare(
    rows: int = 32, vocab: int = 5003, chunk_size: int = 20, seed: int = 0, hidden: int = 32, block: int = 4
) -> dict:
    """DSpark's Markov objective (recipes/dspark.py, a bf16 drafter as the engine's working
    weights; rows in blocks of `block` predicting positions) with the FP8 lm_head ("triton_fp8")
    and with the bf16 one ("triton"), both in chunks of 16 rows, each against the dense float64
    reference: relative errors of the loss and of the gradients (norms) of the rows and of the
    Markov head's parameters. W's scale gives the logits the same spread at any width (0.05 at
    64)."""
    from dataclasses import replace

    from dflash_core.fp8 import quantize_head
    from dflash_core.recipes.dspark import dspark_loss, reference_dspark_loss
    from dflash_core.step.inputs import RowLossInputs
    from dflash_core.step.objectives import ObjectiveInputs
    from tests.helpers import random_drafter, tiny_drafter_config

    cfg = replace(tiny_drafter_config(vocab_size=vocab, hidden=hidden), recipe="dspark", markov_rank=16)
    drafter = random_drafter(cfg, seed=1).bfloat16()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a Markov bias that is not at its init
        drafter.markov_head.markov_w2.weight.copy_(torch.randn(vocab, 16, generator=g) * 0.5)
    w = (torch.randn(vocab, hidden, generator=g) * (0.4 / hidden**0.5)).bfloat16()
    h = (torch.randn(rows, hidden, generator=g) * 4).bfloat16()
    ht = (h.float() + torch.randn(rows, hidden, generator=g) * 2).bfloat16()  # a teacher near the drafter
    prev, labels = torch.randint(0, vocab, (rows,), generator=g), torch.randint(0, vocab, (rows,), generator=g)
    labels[::3] = (h.float() @ w.float().t()).argmax(-1)[::3]
    decayed = torch.rand(rows, generator=g).view(-1, block)
    objective = ObjectiveInputs("cpu")
    # no confidence BCE: its gradient (bf16, unchanged by the lm_head's precision) would hide the
    # lm_head GEMMs' part of the rows' gradient
    objective.mix, objective.conf = torch.tensor([0.1, 0.2, 0.9]), torch.tensor(0.0)
    heads = [p for n, p in drafter.named_parameters() if "markov" in n]
    names = ["rows", *(n for n, _ in drafter.named_parameters() if "markov" in n)]

    def loss_and_grads(lm_head, kernel, reference=False):
        rows_ = h.clone().requires_grad_()
        inputs = RowLossInputs(rows_, ht, lm_head, prev.view(-1, block), labels, decayed, objective, chunk_size, kernel)
        if reference:
            loss = reference_dspark_loss(drafter, inputs, drafter.markov_head.markov_w1(prev))
        else:
            loss = dspark_loss(drafter, inputs)[0]
        return loss.detach().double(), torch.autograd.grad(loss, [rows_, *heads])

    ref_loss, ref_grads = loss_and_grads(w, "eager", reference=True)
    out = {}
    for name, lm_head, kernel in (("fp8", quantize_head(w), "triton_fp8"), ("bf16", w, "triton")):
        loss, grads = loss_and_grads(lm_head, kernel)
        out[name] = {
            "loss_rel": float((loss - ref_loss).abs() / ref_loss.abs()),
            "grad_rel": {n: _norm_rel(a, b) for n, a, b in zip(names, grads, ref_grads, strict=True)},
        }
    return out


def micro_step_fp8_compare(
    vocab: int = 1003, seq_len: int = 24, anchors: int = 8, block_size: int = 5, chunk_size: int = 20
) -> dict:
    """A whole objective micro-step (a tiny fp32 drafter, the DFlash recipe, a ce + kl + tv mix
    with D-PACE weights, 32 rows (8 anchors, 4 predicting positions each) over 24 context
    positions: the teacher's logits per position) with the loss kernel "triton_fp8" (an Fp8Head
    over a vocabulary FP8 pads, chunks of 16 rows, chunk_size 20) against "triton": the loss's
    relative error and the smallest cosine of a parameter gradient."""
    import numpy as np

    from dflash_core.config import ShapeConfig
    from dflash_core.drafter import FrozenHead
    from dflash_core.fp8 import quantize_head
    from dflash_core.step.micro_step import StepKernels, StepSettings, micro_step
    from dflash_core.step.objectives import ObjectiveInputs, objective_of
    from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config

    cfg = tiny_drafter_config(vocab_size=vocab, block_size=block_size, hidden=64)
    shape = ShapeConfig(seq_len=seq_len, num_anchors=anchors, block_size=block_size)
    mb = random_micro_batch(np.random.default_rng(4), shape, vocab=vocab)
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(torch.randn(vocab, 64, generator=g), torch.randn(vocab, 64, generator=g) * 0.05)
    head.lm_head_fp8 = quantize_head(head.lm_head_weight)
    feats = torch.randn(seq_len, (cfg.num_target_features + 1) * 64, generator=g) * 4
    objective = ObjectiveInputs("cpu")
    objective.set(objective_of({"ce": 0.3, "kl": 0.5, "tv": 0.9}, "dpace", 0.5))
    out = {}
    for kernel in ("triton", "triton_fp8"):
        drafter = random_drafter(cfg).float()
        settings = StepSettings("dense", 2.0, chunk_size, StepKernels(loss=kernel), objective).with_hooks(cfg)
        res = micro_step(drafter, head, mb, feats, settings)
        out[kernel] = (res.loss.detach(), torch.autograd.grad(res.loss, list(drafter.parameters())))
    (ref_loss, ref_grads), (loss, grads) = out["triton"], out["triton_fp8"]
    return {
        "loss_rel": float((loss - ref_loss).abs() / ref_loss.abs()),
        "grad_cosine_min": min(_cosine(a, b) for a, b in zip(grads, ref_grads, strict=True)),
        "rows": anchors * (block_size - 1),
    }


def main(flags: list[str]) -> dict:
    """The CPU check's result (`--fp8`, `--fp8-dspark`: the module docstring's)."""
    if "--fp8" in flags:
        return {"chunk": fp8_compare(), "micro_step": micro_step_fp8_compare()}
    if "--fp8-dspark" in flags:
        return dspark_fp8_compare()
    return {"one_block": compare(vocab=1500), "several_blocks": compare(vocab=9000, seed=1)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
