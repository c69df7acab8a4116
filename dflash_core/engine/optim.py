"""AdamW over fp32 master weights with a linear-warmup cosine schedule."""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, lr: float, weight_decay: float, betas, device: torch.device) -> torch.optim.Optimizer:
    # fused AdamW on CUDA (one kernel set per step); foreach on CPU. The learning rate is a
    # Python float set from the host every step (set_lr): the schedule needs no device sync.
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=1e-8, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
