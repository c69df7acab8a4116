"""The Triton distillation chunk (dflash_core/kernels/distill.py) against the eager one
(step/objectives.py): the same ce, kl and tv per row, argmax hits and mixed row gradient. Runs on
CUDA (tests/gpu) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.distill_check` (the flag is read when the kernel module is
imported)."""

from __future__ import annotations

import json

import torch

from dflash_core.kernels.distill import BLOCK_V, chunk_terms
from dflash_core.step.objectives import chunk_terms_eager


def compare(
    device: str = "cpu", rows: int = 23, hidden: int = 32, vocab: int = 5000, dtype=torch.float32, seed: int = 0
) -> dict:
    """Relative differences of the terms and the gradient for a mix with every term weighted, and
    the argmax disagreements. Some rows' teacher equals the drafter (kl = tv = 0, sign 0)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.2
    h = torch.randn(rows, hidden, generator=g)
    ht = torch.randn(rows, hidden, generator=g)
    ht[:3] = h[:3]
    labels = torch.randint(0, vocab, (rows,), generator=g)
    right = (h @ w.t()).argmax(-1)
    labels[5::2] = right[5::2]
    mix = torch.tensor([0.3, 0.5, 0.9])
    h, ht, w, labels, mix = (
        h.to(device, dtype),
        ht.to(device, dtype),
        w.to(device, dtype),
        labels.to(device),
        mix.to(device),
    )
    zt = ht @ w.t()
    ref_terms, ref_hits, ref_grad = chunk_terms_eager(h, zt, w, labels, mix, True)
    terms, hits, grad = chunk_terms(h, zt, w, labels, mix, True)
    terms_only, hits_only, none = chunk_terms(h, zt, w, labels, mix, False)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

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
    }


if __name__ == "__main__":
    print(json.dumps({"one_block": compare(vocab=1500), "several_blocks": compare(vocab=9000, seed=1)}))
