"""AdamW over fp32 master weights with a linear-warmup cosine schedule, and the clipped step."""

from __future__ import annotations

import math
from typing import Any

import torch

try:  # the GPU image's torch brings Triton; a CPU-only install may not have it
    from ..kernels.adamw import TritonAdamW
except ImportError:
    TritonAdamW = None  # type: ignore[assignment,misc]  # callers check for None: Triton is optional


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params, lr: float, weight_decay: float, betas, device: torch.device, working_copies=None
) -> torch.optim.Optimizer:
    """working_copies: bf16 working weights beside fp32 `params` (TritonAdamW's argument; CUDA)."""
    # CUDA: one Triton kernel per tensor (adamw_triton.py says why); torch's fused AdamW where
    # Triton is missing; foreach on CPU. The learning rate is a Python float set from the host
    # every step (set_lr): the schedule needs no device sync.
    if device.type == "cuda" and TritonAdamW is not None:
        return TritonAdamW(
            params, lr=lr, betas=tuple(betas), eps=1e-8, weight_decay=weight_decay, working_copies=working_copies
        )
    if working_copies is not None and any(w is not None for w in working_copies):
        raise ValueError("bf16 working weights need the Triton AdamW (CUDA with Triton)")
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=1e-8, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Resume `opt` from a saved state_dict, ours or torch AdamW's, keeping `opt`'s own
    implementation: loading replaces the param groups with the saved ones, and a torch AdamW
    would otherwise take the saver's fused/foreach switches (or none, from TritonAdamW)."""
    switches: list[dict[str, Any]] = [
        {k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups
    ]
    opt.load_state_dict(state)
    for group, own in zip(opt.param_groups, switches):
        group.update(own)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of gradients on one device, accumulated in fp32 whatever their dtypes
    (bf16 gradients of working weights: get_total_norm would round each tensor's norm to bf16)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    norms = [n for group in by_dtype.values() for n in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clipped_step(opt: torch.optim.Optimizer, grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the step's gradients (the tensors the optimizer reads) to a global L2 norm of
    max_norm (<= 0: no clipping), then step; the norm before clipping (measured either way), on
    the device. The same
    result as clip_grad_norm_ then step; with TritonAdamW the scaling happens inside the
    optimizer's kernel, so the gradients are left unscaled (nothing reads them before they are
    zeroed)."""
    if not grads:
        opt.step()
        return torch.zeros((), device=opt.param_groups[0]["params"][0].device)
    norm = grad_norm(grads)  # measured with clipping off too: the non-finite guard and the metrics read it
    if max_norm <= 0:
        opt.step()
        return norm
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s; 1 leaves small ones alone
    if TritonAdamW is not None and isinstance(opt, TritonAdamW):
        opt.step(grad_scale=coefficient)
    else:
        torch._foreach_mul_(grads, coefficient)
        opt.step()
    return norm
