"""Decay-weighted block cross-entropy through the frozen LM head, chunked over query tokens.

Full logits [Q, vocab] never exist: each chunk of query tokens computes its logits, its CE and
the gradient of the loss with respect to its hidden states at once (the LM head is frozen, so no
weight gradient is needed), then drops the logits. Backward only scales the stored gradient.
Loss = sum_q w_q * CE_q / sum_q w_q.
"""

from __future__ import annotations

import functools

import torch

from ..fp8 import Fp8Head


def _chunk_ce(hidden, lm_head_weight, labels, w):
    """One chunk's fp32 logits, their logsumexp, the weighted CE sum and argmax hits."""
    logits = (hidden @ lm_head_weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    loss = ((lse - target_logit) * w).sum()
    correct = logits.argmax(dim=-1) == labels
    return logits, lse, loss, correct


def _chunk_loss_and_grad(hidden, lm_head_weight, labels, w, need_grad: bool):
    """One chunk, eager: weighted CE sum, argmax hits, and d(loss)/d(hidden) (w already normalized).
    The gradient is built in place on one [chunk, vocab] buffer: eager ops would otherwise each
    allocate another one."""
    logits, lse, loss, correct = _chunk_ce(hidden, lm_head_weight, labels, w)
    if not need_grad:
        return loss, correct, None
    # softmax - onehot, scaled, in place on one [chunk, vocab] buffer (no one-hot tensor)
    grad_logits = (logits - lse.unsqueeze(1)).exp_()
    grad_logits.scatter_add_(1, labels.unsqueeze(1), torch.full_like(w, -1.0).unsqueeze(1))
    grad_logits.mul_(w.unsqueeze(1))
    return loss, correct, (grad_logits.to(lm_head_weight.dtype) @ lm_head_weight).to(hidden.dtype)


def _chunk_loss_and_grad_fusible(hidden, lm_head_weight, labels, w, need_grad: bool):
    """The same chunk math for torch.compile: the gradient as one pure expression, the one-hot as
    an index comparison. Inductor then reads the logits and writes the low-precision gradient in
    one pass; the in-place form makes it write an fp32 [chunk, vocab] buffer (scatter_add) and
    read it again to scale and cast it."""
    logits, lse, loss, correct = _chunk_ce(hidden, lm_head_weight, labels, w)
    if not need_grad:
        return loss, correct, None
    is_label = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == labels.unsqueeze(1)
    grad_logits = (torch.exp(logits - lse.unsqueeze(1)) - is_label.to(logits.dtype)) * w.unsqueeze(1)
    return loss, correct, (grad_logits.to(lm_head_weight.dtype) @ lm_head_weight).to(hidden.dtype)


@functools.cache
def compiled_chunk_loss():
    """The chunk math compiled: logits cast, logsumexp, argmax, softmax gradient, scaling and the
    cast fuse into a few passes over the [chunk, vocab] logits instead of one pass per eager op."""
    return torch.compile(_chunk_loss_and_grad_fusible, dynamic=False)


LOSS_KERNELS = ("eager", "compiled", "triton", "triton_fp8")


def chunk_function(kernel: str):
    """The chunk implementation: "eager" (in-place torch ops), "compiled" (inductor fuses the CE
    passes), "triton" (CUDA: kernels.ce's two-pass kernel between the two GEMMs, nothing compiled)
    or "triton_fp8" (the same with FP8 GEMMs; the weight is then an fp8.Fp8Head)."""
    if kernel == "eager":
        return _chunk_loss_and_grad
    if kernel == "compiled":
        return compiled_chunk_loss()
    if kernel == "triton":
        from ..kernels.ce import chunk_loss_and_grad  # Triton may be missing on CPU-only installs

        return chunk_loss_and_grad
    if kernel == "triton_fp8":
        from ..kernels.ce import chunk_loss_and_grad_fp8

        return chunk_loss_and_grad_fp8
    raise ValueError(f"loss kernel must be one of {LOSS_KERNELS}, got {kernel!r}")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head_weight, labels, weights, chunk_size: int, kernel: str):
        need_grad = ctx.needs_input_grad[0]
        chunk_fn = chunk_function(kernel)
        w_all = weights / weights.sum().clamp_min(1e-6)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        rows = hidden.shape[0]
        chunks = -(-rows // chunk_size)
        chunk = -(-rows // chunks)  # near-equal chunks of at most chunk_size: at most two compiled shapes
        if kernel == "triton_fp8":  # FP8 GEMMs take rows in multiples of 16
            chunk = -(-chunk // 16) * 16
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part, hits, grad = chunk_fn(
                hidden[start:end], lm_head_weight, labels[start:end], w_all[start:end], need_grad
            )
            loss = loss + part
            correct[start:end] = hits
            if grad_hidden is not None:  # need_grad
                grad_hidden[start:end] = grad
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        # scale in fp32: grad_loss is e.g. 1/3 with grad_accum=3, which bf16 would round by 0.2 %
        return (grad_hidden.float() * grad_loss.float()).to(grad_hidden.dtype), None, None, None, None, None


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor | Fp8Head,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int,
    kernel: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE (fp32 scalar), argmax == label per query token); kernel: LOSS_KERNELS
    ("triton_fp8": lm_head_weight is an fp8.Fp8Head)."""
    return _ChunkedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights.float(), chunk_size, kernel)


def reference_lm_head_loss(hidden, lm_head_weight, labels, weights):
    """Unchunked float64 reference, for tests."""
    logits = hidden.double() @ lm_head_weight.double().t()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (ce * weights.double()).sum() / weights.double().sum().clamp_min(1e-6)
