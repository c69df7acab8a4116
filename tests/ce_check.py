"""The Triton loss chunk (dflash_core/kernels/ce.py) against the eager one (loss.py): the same
weighted CE sum, argmax hits (first index on ties) and hidden-state gradient. Runs on CUDA
(tests/gpu, bf16 at the real vocabulary) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.ce_check` (a separate process: the flag is read when the
kernel module is imported)."""

from __future__ import annotations

import json
import sys

import torch

from dflash_core.kernels.ce import BLOCK_V, chunk_loss_and_grad
from dflash_core.step.loss import _chunk_loss_and_grad


def compare(
    device: str = "cpu", rows: int = 25, hidden: int = 64, vocab: int = 5000, dtype=torch.float32, seed: int = 0
) -> dict:
    """Relative differences of loss and gradient, and the number of argmax disagreements. Vocab
    entries 7 and vocab - 3 share a weight row, so every row's logits tie there: in rows 0-4 that
    tie is the maximum, and the argmax must break it to the first index (7). Rows 5, 7, ... answer
    with their argmax: at 25 rows those fall in each of the three vocabulary blocks of 9000."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    twin = vocab - 3  # in the last block when the vocabulary spans several
    w[twin] = w[7]
    h = torch.randn(rows, hidden, generator=g)
    h[:5] = w[7] * 40  # logit 7 (and its twin) the largest in these rows
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0], labels[1] = 7, twin  # a right and a wrong answer at the tie
    # every other row from 5 on answers with its argmax (spread over the vocabulary blocks), so a
    # wrong argmax index anywhere shows as a hit mismatch
    right = (h @ w.t()).argmax(-1)
    labels[5::2] = right[5::2]
    weights = torch.rand(rows, generator=g)
    weights[2] = 0.0
    weights = weights / weights.sum()
    h, w, labels, weights = h.to(device, dtype), w.to(device, dtype), labels.to(device), weights.to(device)
    out = {}
    ref_loss, ref_hits, ref_grad = _chunk_loss_and_grad(h, w, labels, weights, True)
    loss, hits, grad = chunk_loss_and_grad(h, w, labels, weights, True)
    loss_only, hits_only, none = chunk_loss_and_grad(h, w, labels, weights, False)
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))  # noqa: E731
    out["loss_rel"] = rel(loss, ref_loss)
    out["grad_rel"] = rel(grad, ref_grad)
    out["hit_mismatches"] = int((hits != ref_hits).sum())
    out["hits"] = int(ref_hits.sum())
    out["argmax_blocks"] = len(set((right[5::2] // BLOCK_V).tolist()))  # vocabulary blocks the kernel walks
    out["tie_rows_first_index"] = bool(hits[0]) and not bool(hits[1])
    # the forward-only launch is another compiled variant of the kernel: same pass 1, so the same
    # loss up to the compiler's scheduling
    out["loss_only_same"] = (
        abs(float(loss_only) - float(loss)) <= 1e-6 * abs(float(loss))
        and bool((hits_only == hits).all())
        and none is None
    )
    return out


def out_of_range_label_gives_nan(device: str = "cpu") -> bool:
    """A label past the vocabulary makes the loss NaN (the kernel never reads past the row)."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 16, generator=g).to(device), torch.randn(300, 16, generator=g).to(device)
    labels = torch.tensor([1, 300 + 7, 2, -100]).to(device)
    loss, _, _ = chunk_loss_and_grad(h, w, labels, torch.full((4,), 0.25).to(device), True)
    return bool(torch.isnan(loss))


def micro_step_compare() -> dict:
    """A whole micro-step (a tiny fp32 drafter, chunks of 5 rows, position 0 skipped) with the
    Triton loss against the eager one: loss, every parameter gradient, hits (CPU)."""
    import numpy as np

    from dflash_core.config import ShapeConfig
    from dflash_core.drafter import FrozenHead
    from dflash_core.step.micro_step import EAGER, StepKernels, StepSettings, micro_step
    from tests.helpers import random_drafter, random_micro_batch, tiny_drafter_config

    cfg = tiny_drafter_config(block_size=4)
    shape = ShapeConfig(seq_len=48, num_anchors=6, block_size=4)
    mb = random_micro_batch(np.random.default_rng(4), shape, n_docs=2)
    g = torch.Generator().manual_seed(0)
    head = FrozenHead(torch.randn(64, cfg.hidden_size, generator=g), torch.randn(64, cfg.hidden_size, generator=g))
    feats = torch.randn(48, 2 * cfg.hidden_size, generator=g)
    results = []
    for kernels in (EAGER, StepKernels(loss="triton")):
        drafter = random_drafter(cfg).float()
        res = micro_step(drafter, head, mb, feats, StepSettings("dense", 2.0, 5, kernels))
        res.loss.backward()
        results.append((res, {n: p.grad for n, p in drafter.named_parameters()}))
    (ref, ref_grads), (got, grads) = results
    return {
        "loss_rel": _rel(got.loss, ref.loss),
        "grad_rel_max": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
        "hits_equal": bool(torch.equal(got.correct, ref.correct)),
        "hits": int(ref.correct.sum()),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        (a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp_min(1e-12)
    )


def fp8_compare(rows: int = 32, hidden: int = 64, vocab: int = 5003, seed: int = 0) -> dict:
    """The FP8 chunk (kernels.ce.chunk_loss_and_grad_fp8, bf16 inputs, a vocabulary FP8 pads)
    against the fp32 eager chunk: relative loss and gradient errors (norms), hit mismatches."""
    from dflash_core.fp8 import quantize_head
    from dflash_core.kernels.ce import chunk_loss_and_grad_fp8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    h = torch.randn(rows, hidden, generator=g) * 4
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::2] = (h @ w.t()).argmax(-1)[::2]  # some right answers
    weights = torch.rand(rows, generator=g)
    weights = weights / weights.sum()
    ref_loss, ref_hits, ref_grad = _chunk_loss_and_grad(h, w, labels, weights, True)
    head = quantize_head(w.bfloat16())
    loss, hits, grad = chunk_loss_and_grad_fp8(h.bfloat16(), head, labels, weights, True)
    norm_rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    return {
        "loss_rel": norm_rel(loss, ref_loss),
        "grad_rel": norm_rel(grad, ref_grad),
        "hit_mismatches": int((hits != ref_hits).sum()),
        "rows": rows,
        "vocab": vocab,
        "padded_vocab": int(head.rows.shape[0]),
    }


def main(flags: list[str]) -> dict:
    """The CPU check's result (`--fp8`: the FP8 chunk's)."""
    if "--fp8" in flags:
        return fp8_compare()
    return {
        "one_block": compare(vocab=1500),
        "several_blocks": compare(vocab=9000),
        "exact_blocks": compare(vocab=2 * BLOCK_V, seed=1),
        "bad_label_nan": out_of_range_label_gives_nan(),
        "micro_step": micro_step_compare(),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
