"""AdamW over fp32 master weights with a linear-warmup cosine schedule, and the clipped step."""
from __future__ import annotations

import math

import torch

try:  # the GPU image's torch brings Triton; a CPU-only install may not have it
    from .adamw_triton import TritonAdamW
except ImportError:
    TritonAdamW = None


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, lr: float, weight_decay: float, betas, device: torch.device) -> torch.optim.Optimizer:
    # CUDA: one Triton kernel per tensor (adamw_triton.py says why); torch's fused AdamW where
    # Triton is missing; foreach on CPU. The learning rate is a Python float set from the host
    # every step (set_lr): the schedule needs no device sync.
    if device.type == "cuda" and TritonAdamW is not None:
        return TritonAdamW(params, lr=lr, betas=tuple(betas), eps=1e-8, weight_decay=weight_decay)
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=1e-8, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Resume `opt` from a saved state_dict, ours or torch AdamW's, keeping `opt`'s own
    implementation: loading replaces the param groups with the saved ones, and a torch AdamW
    would otherwise take the saver's fused/foreach switches (or none, from TritonAdamW)."""
    switches = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups]
    opt.load_state_dict(state)
    for group, own in zip(opt.param_groups, switches):
        group.update(own)


def clipped_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients to a global L2 norm of max_norm (<= 0: no clipping), then step; the
    norm before clipping, on the device. Same parameters as clip_grad_norm_ then step; with
    TritonAdamW the scaling happens inside the optimizer's kernel, so p.grad is left unscaled
    (nothing reads it before the gradients are zeroed)."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm <= 0 or not grads:
        opt.step()
        return torch.zeros((), device=params[0].device)
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if TritonAdamW is not None and isinstance(opt, TritonAdamW):
        # clip_grads_with_norm_'s coefficient, clamped to 1 so small gradients are left alone
        opt.step(grad_scale=torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        opt.step()
    return norm
