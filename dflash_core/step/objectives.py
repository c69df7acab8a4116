"""Training objectives beyond the DFlash block CE: distillation to the target's own next-token
distribution (KL, TV, weighted mixes with CE) and D-PACE position weights.

An objective is a mix of per-position terms, each computed beside the drafter's logits in the
same chunked pass over the lm_head (never a [positions x vocab] tensor of the micro-batch):
  ce  = -log p_d(label)
  kl  = KL(p_t || p_d) = sum p_t (log p_t - log p_d)        (forward KL, the distillation default)
  tv  = 1/2 sum |p_d - p_t|                                  (total variation, DSpark's)
where p_d = softmax(lm_head(drafter hidden)) and p_t = softmax(lm_head(target final-norm hidden
at the position before the label)): the target's own distribution for that token. A position's
loss is  ce_w * ce + kl_w * kl + tv_w * tv;  the micro-batch's loss is the weighted mean of
that over positions, with the position weights of `position_weights`.

The chunk computes every term and its gradient per row without the position weight; the weight
enters through autograd (d loss / d row = w_row / sum w), so position weights that depend on
the whole block (D-PACE reads the drafter's probabilities of all positions of a block) need
no second pass over the lm_head.

The mix weights, the D-PACE switch and alpha are tensors the replica holds (ObjectiveInputs):
the recorded step reads them, so one recorded step serves every job's objective.
"""

from __future__ import annotations

import torch

from ..fp8 import FP8_MULTIPLE
from .objective_spec import DEFAULT_DPACE_ALPHA, POSITION_WEIGHTS, TERMS, Objective, objective_of, parse_loss
from .teacher import Head, RowLse, TeacherLogits, dense_logits, teacher_logits

__all__ = ["DEFAULT_DPACE_ALPHA", "POSITION_WEIGHTS", "TERMS", "Objective", "objective_of", "parse_loss"]


class ObjectiveInputs:
    """The objective as device tensors: what the recorded step reads (set() writes them in place,
    so a recorded graph sees the new values)."""

    def __init__(self, device: torch.device | str):
        self.mix = torch.zeros(3, dtype=torch.float32, device=device)
        self.dpace = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: D-PACE weights
        self.alpha = torch.zeros((), dtype=torch.float32, device=device)
        self.conf = torch.zeros((), dtype=torch.float32, device=device)  # DSpark's confidence BCE
        self.set(Objective())

    def set(self, objective: Objective) -> None:
        self.mix.copy_(torch.tensor(objective.mix, dtype=torch.float32))
        self.dpace.fill_(1.0 if objective.position_weights == "dpace" else 0.0)
        self.alpha.fill_(objective.dpace_alpha)
        self.conf.fill_(objective.conf)


# ----------------------------------------------------------------------------- D-PACE
def dpace_weight(prob: torch.Tensor, valid: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """D-PACE position weights (SpecForge `_dpace_weight`, loss_type "dpace"): detached.

    prob [N, K]: the drafter's probability of the label at each predicting position of a block;
    valid [N, K] bool. smooth = (1 - alpha) p + alpha (1 at invalid positions: a no-op in the
    product); prefix = cumprod(smooth) (the chance the draft reaches this position);
    weight = suffix sum of prefix over valid positions (the acceptance length still ahead)."""
    prob = prob.detach().float()
    smooth = (1.0 - alpha) * prob + alpha
    smooth = torch.where(valid, smooth, torch.ones_like(smooth))
    prefix = torch.cumprod(smooth, dim=-1)
    return torch.flip(torch.cumsum(torch.flip(prefix * valid, dims=[-1]), dim=-1), dims=[-1])


def position_weights(decayed: torch.Tensor, ce: torch.Tensor, inputs: ObjectiveInputs) -> torch.Tensor:
    """[N, K] weights of the predicting positions: the decayed weights, or (D-PACE switched on)
    the D-PACE weights of the valid ones. Both are computed and selected by the switch tensor,
    so the recorded step holds one path for either."""
    valid = decayed > 0
    dpace = dpace_weight(torch.exp(-ce.detach()), valid, inputs.alpha) * valid
    return torch.where(inputs.dpace > 0, dpace, decayed)


# ----------------------------------------------------------------------------- chunk math
def logit_terms_eager(zd, zt, labels, mix, need_grad: bool):
    """On given logits [rows, vocab]: (terms [rows, 3] fp32 = ce, kl, tv; argmax hits [rows];
    d(sum_i mix_i * term_i)/d(zd) per row in zd's dtype, unweighted, or None). fp32 math; zt
    the teacher's logits or step.teacher.TeacherRows."""
    zd32, zt32 = zd.float(), dense_logits(zt).float()
    logp_d = torch.log_softmax(zd32, dim=-1)
    logp_t = torch.log_softmax(zt32, dim=-1)
    pd, pt = logp_d.exp(), logp_t.exp()
    ce = -logp_d.gather(1, labels.unsqueeze(1)).squeeze(1)
    kl = (pt * (logp_t - logp_d)).sum(-1)
    diff = pd - pt
    tv = 0.5 * diff.abs().sum(-1)
    correct = zd32.argmax(dim=-1) == labels
    terms = torch.stack([ce, kl, tv], dim=1)
    if not need_grad:
        return terms, correct, None
    sign = torch.sign(diff)
    sigma = (sign * pd).sum(-1, keepdim=True)
    is_label = torch.arange(zd.shape[1], device=zd.device).unsqueeze(0) == labels.unsqueeze(1)
    grad = mix[0] * (pd - is_label.float()) + mix[1] * (pd - pt) + mix[2] * 0.5 * pd * (sign - sigma)
    return terms, correct, grad.to(zd.dtype)


def chunk_terms_eager(hidden, zt, lm_head_weight, labels, mix, need_grad: bool):
    """One chunk of rows and their teacher logits zt (or TeacherRows): (terms [rows, 3] fp32 =
    ce, kl, tv; argmax hits [rows]; d(sum_i mix_i * term_i)/d(hidden) per row, unweighted, or
    None). fp32 math on the logits."""
    zd = hidden @ lm_head_weight.t()
    terms, correct, grad = logit_terms_eager(zd.float(), zt, labels, mix, need_grad)
    if grad is None:
        return terms, correct, None
    return terms, correct, (grad.to(lm_head_weight.dtype) @ lm_head_weight).to(hidden.dtype)


OBJECTIVE_KERNELS = ("eager", "triton", "triton_fp8")


def logit_terms_function(kernel: str):
    """The logits-level chunk: "triton" on CUDA (kernels.distill), "triton_fp8" the same with its
    gradient written in FP8 for an fp8.Fp8Head's GEMM (kernels.distill.logit_terms_fp8: its own
    arguments), else the eager one."""
    if kernel == "triton":
        from ..kernels.distill import logit_terms

        return logit_terms
    if kernel == "triton_fp8":
        from ..kernels.distill import logit_terms_fp8

        return logit_terms_fp8
    return logit_terms_eager


def objective_chunk_function(kernel: str):
    """ "triton" on CUDA (kernels.distill), "triton_fp8" the same with the lm_head GEMMs in FP8
    (the head is then an fp8.Fp8Head), else the eager chunk (the loss kernel "compiled" maps here
    too: the objective's chunk is not compiled, so it never needs a compile at run time)."""
    if kernel == "triton":
        from ..kernels.distill import chunk_terms  # Triton may be missing on CPU-only installs

        return chunk_terms
    if kernel == "triton_fp8":
        from ..kernels.distill import chunk_terms_fp8

        return chunk_terms_fp8
    return chunk_terms_eager


def teacher_lse_function(kernel: str) -> RowLse | None:
    """What forms the teacher rows' logsumexp for the Triton chunks (kernels.distill.row_logsumexp:
    once per table where the chunks index one, else per chunk), or None: the eager chunk
    normalizes its own rows."""
    if kernel in ("triton", "triton_fp8"):
        from ..kernels.distill import row_logsumexp

        return row_logsumexp
    return None


def chunk_rows(rows: int, chunk_size: int, kernel: str) -> int:
    """Rows per chunk: near-equal chunks of at most chunk_size, in multiples of 16 for the FP8
    GEMMs (which take no other row counts; the last chunk's rows are one too, as the loss's rows
    are: fp8.check_fp8_shapes)."""
    chunks = -(-rows // chunk_size)
    chunk = -(-rows // chunks)
    if kernel == "triton_fp8":
        chunk = -(-chunk // FP8_MULTIPLE) * FP8_MULTIPLE
    return chunk


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, teacher: TeacherLogits, lm_head_weight, labels, mix, chunk_size: int, kernel: str):
        need_grad = ctx.needs_input_grad[0]
        chunk_fn = objective_chunk_function(kernel)
        lse_fn = teacher_lse_function(kernel)
        rows = hidden.shape[0]
        terms = torch.empty(rows, 3, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        grad_rows = torch.empty_like(hidden) if need_grad else None
        chunk = chunk_rows(rows, chunk_size, kernel)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            t, hits, g = chunk_fn(
                hidden[start:end], teacher.rows(start, end, lse_fn), lm_head_weight, labels[start:end], mix, need_grad
            )
            terms[start:end] = t
            correct[start:end] = hits
            if grad_rows is not None:
                grad_rows[start:end] = g
        teacher.release()
        mixed = terms @ mix
        if need_grad:
            ctx.save_for_backward(grad_rows)
        ctx.mark_non_differentiable(terms, correct)
        return mixed, terms, correct

    @staticmethod
    def backward(ctx, grad_mixed, _grad_terms, _grad_correct):
        (grad_rows,) = ctx.saved_tensors
        grad = (grad_rows.float() * grad_mixed.float().unsqueeze(1)).to(grad_rows.dtype)
        return grad, None, None, None, None, None, None


def chunked_objective_terms(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | TeacherLogits,
    lm_head_weight: Head,
    labels: torch.Tensor,
    mix: torch.Tensor,
    chunk_size: int,
    kernel: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed loss per row [rows] fp32 with its graph, terms [rows, 3] (ce, kl, tv), argmax hits).
    teacher_hidden: the rows' teacher hidden states [rows, H], or their TeacherLogits;
    lm_head_weight: an fp8.Fp8Head for the kernel "triton_fp8", else the [V, H] tensor."""
    teacher = teacher_logits(teacher_hidden, lm_head_weight)
    return _ChunkedObjective.apply(hidden, teacher, lm_head_weight, labels, mix.float(), chunk_size, kernel)


def weighted_objective_loss(mixed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean of the per-row losses (weights detached)."""
    w = weights.detach().float()
    return (mixed * w).sum() / w.sum().clamp_min(1e-6)


def reference_objective(
    hidden, teacher_hidden, lm_head_weight, labels, weights, mix, dpace=False, alpha=0.5, block=None
):
    """Dense float64 reference of the whole objective, for tests: every term on the full
    [rows, vocab] logits, autograd for the gradient. block: positions per block (rows = N * K)
    when D-PACE weights are asked for."""
    zd = hidden.double() @ lm_head_weight.double().t()
    zt = teacher_hidden.double() @ lm_head_weight.double().t()
    logp_d, logp_t = torch.log_softmax(zd, -1), torch.log_softmax(zt, -1)
    ce = torch.nn.functional.nll_loss(logp_d, labels, reduction="none")
    kl = torch.nn.functional.kl_div(logp_d, logp_t, reduction="none", log_target=True).sum(-1)
    tv = 0.5 * (logp_d.exp() - logp_t.exp()).abs().sum(-1)
    per_row = mix[0] * ce + mix[1] * kl + mix[2] * tv
    w = weights.double()
    if dpace:
        assert block is not None
        k = block
        valid = (w > 0).view(-1, k)
        w = (dpace_weight(torch.exp(-ce.detach()).view(-1, k), valid, alpha).double() * valid).view(-1)
    return (per_row * w).sum() / w.sum().clamp_min(1e-6)
