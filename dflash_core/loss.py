"""Decay-weighted block cross-entropy through the frozen LM head, chunked over query tokens.

Full logits [Q, vocab] never exist: each chunk of query tokens computes its logits, its CE and
the gradient of the loss with respect to its hidden states at once (the LM head is frozen, so no
weight gradient is needed), then drops the logits. Backward only scales the stored gradient.
Loss = sum_q w_q * CE_q / sum_q w_q.
"""
from __future__ import annotations

import torch


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head_weight, labels, weights, chunk_size: int):
        need_grad = ctx.needs_input_grad[0]
        total_weight = weights.sum().clamp_min(1e-6)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:end] @ lm_head_weight.t()).float()
            lab = labels[start:end]
            w = weights[start:end] / total_weight
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, lab.unsqueeze(1)).squeeze(1)
            loss = loss + ((lse - target_logit) * w).sum()
            correct[start:end] = logits.argmax(dim=-1) == lab
            if need_grad:
                probs = torch.exp(logits.sub_(lse.unsqueeze(1)))  # softmax, in place of the logits
                probs.scatter_add_(1, lab.unsqueeze(1), torch.full_like(w, -1.0).unsqueeze(1))
                probs.mul_(w.unsqueeze(1))
                grad_hidden[start:end] = (probs.to(lm_head_weight.dtype) @ lm_head_weight).to(hidden.dtype)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None


def chunked_lm_head_loss(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE (fp32 scalar), argmax == label per query token)."""
    return _ChunkedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights.float(), chunk_size)


def reference_lm_head_loss(hidden, lm_head_weight, labels, weights):
    """Unchunked float64 reference, for tests."""
    logits = (hidden.double() @ lm_head_weight.double().t())
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (ce * weights.double()).sum() / weights.double().sum().clamp_min(1e-6)
