"""The Triton loss chunk (dflash_core/ce_triton.py) against the eager one (loss.py): the same
weighted CE sum, argmax hits (first index on ties) and hidden-state gradient. Runs on CUDA
(tests/gpu, bf16 at the real vocabulary) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.ce_check` (a separate process: the flag is read when the
kernel module is imported)."""
from __future__ import annotations

import json

import torch

from dflash_core.ce_triton import chunk_loss_and_grad
from dflash_core.loss import _chunk_loss_and_grad


def compare(device: str = "cpu", rows: int = 37, hidden: int = 64, vocab: int = 5000, dtype=torch.float32,
            seed: int = 0) -> dict:
    """Relative differences of loss and gradient, and the number of argmax disagreements. Vocab
    entries 7 and vocab - 3 share a weight row, so every row's logits tie there: in rows 0-4 that
    tie is the maximum, and the argmax must break it to the first index (7)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    twin = vocab - 3  # in the last block when the vocabulary spans several
    w[twin] = w[7]
    h = torch.randn(rows, hidden, generator=g)
    h[:5] = w[7] * 40  # logit 7 (and its twin) the largest in these rows
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0], labels[1] = 7, twin  # a right and a wrong answer at the tie
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
    out["tie_rows_first_index"] = bool(hits[0]) and not bool(hits[1])
    # the forward-only launch is another compiled variant of the kernel: same pass 1, so the same
    # loss up to the compiler's scheduling
    out["loss_only_same"] = (abs(float(loss_only) - float(loss)) <= 1e-6 * abs(float(loss))
                             and bool((hits_only == hits).all()) and none is None)
    return out


if __name__ == "__main__":
    print(json.dumps({"one_block": compare(vocab=1500), "several_blocks": compare(vocab=5000),
                      "exact_blocks": compare(vocab=4096, seed=1)}))
