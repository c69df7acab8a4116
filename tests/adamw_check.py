"""TritonAdamW against torch.optim.AdamW: the same parameters, gradients and clipping, a few
steps, then a checkpoint round trip between the two. Runs on CUDA (tests/gpu) and, through
Triton's interpreter, on CPU: `TRITON_INTERPRET=1 python -m tests.adamw_check` (the flag must be
set before the kernel module is imported, hence a separate process)."""
from __future__ import annotations

import copy
import json

import torch

from dflash_core.engine.adamw_triton import TritonAdamW
from dflash_core.engine.optim import clipped_step, set_lr

SHAPES = [(64, 48), (3000,), (7,), (33, 5, 4)]  # not multiples of the kernel's block; one tiny


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(step, device):
    g = torch.Generator().manual_seed(100 + step)
    # steps 0-1 clip (norm ~90 against max_norm 5), step 2 does not (scaled below max_norm)
    scale = 1.0 if step < 2 else 0.02
    return [(torch.randn(s, generator=g) * scale).to(device) for s in SHAPES]


def _set_grads(params, grads):
    for p, gr in zip(params, grads):
        p.grad = gr.clone()


def compare(device: str = "cpu", steps: int = 3) -> dict:
    """Max relative differences (parameters, moments) after `steps` clipped steps, and after a
    state_dict hand-over in each direction followed by one more step."""
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours_p, ref_p = _params(device), _params(device)
    ours = TritonAdamW(ours_p, **kw)
    ref = torch.optim.AdamW(ref_p, **kw, foreach=False)
    norms = []
    for step in range(steps):
        grads = _grads(step, device)
        _set_grads(ours_p, grads)
        _set_grads(ref_p, grads)
        set_lr(ours, kw["lr"] * (step + 1) / steps)
        set_lr(ref, kw["lr"] * (step + 1) / steps)
        n_ours = clipped_step(ours, ours_p, 5.0)
        n_ref = torch.nn.utils.clip_grad_norm_(ref_p, 5.0)
        ref.step()
        norms.append((float(n_ours), float(n_ref)))

    @torch.no_grad()
    def rel(a, b):
        return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))

    out = {
        "params": rel(ours_p, ref_p),
        "exp_avg": rel([ours.state[p]["exp_avg"] for p in ours_p], [ref.state[p]["exp_avg"] for p in ref_p]),
        "exp_avg_sq": rel([ours.state[p]["exp_avg_sq"] for p in ours_p], [ref.state[p]["exp_avg_sq"] for p in ref_p]),
        "norms": rel([torch.tensor(a) for a, _ in norms], [torch.tensor(b) for _, b in norms]),
        "step_on_host": all(ours.state[p]["step"].device.type == "cpu" for p in ours_p),
    }
    # hand-over: torch's state into ours and ours into torch's, one more unclipped step each
    a_p, b_p = _params(device, 1), _params(device, 1)
    for x, y in zip(a_p + b_p, ref_p + ref_p):
        x.data.copy_(y.data)
    from_torch = TritonAdamW(a_p, **kw)
    from_torch.load_state_dict(copy.deepcopy(ref.state_dict()))
    to_torch = torch.optim.AdamW(b_p, **kw, foreach=False)
    to_torch.load_state_dict(copy.deepcopy(ours.state_dict()))
    grads = _grads(steps, device)
    for ps, opt in ((a_p, from_torch), (b_p, to_torch), (ref_p, ref)):
        _set_grads(ps, grads)
        opt.step()
    out["from_torch"] = rel(a_p, ref_p)
    out["to_torch"] = rel(b_p, ref_p)
    return out


if __name__ == "__main__":
    print(json.dumps(compare()))
