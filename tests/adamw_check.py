"""TritonAdamW against torch.optim.AdamW: the same parameters, gradients and clipping, a few
steps, then a checkpoint hand-over in both directions (torch's fused AdamW's state included).
Runs on CUDA (tests/gpu) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.adamw_check` (the flag must be set before the kernel module is
imported, hence a separate process)."""

from __future__ import annotations

import copy
import json
import sys

import torch

from dflash_core.engine.optim import clipped_step, load_optimizer_state, set_lr
from dflash_core.kernels.adamw import TritonAdamW

SHAPES = [(64, 48), (3000,), (7,), (33, 5, 4)]  # not multiples of the kernel's block; one tiny
# a large lr and weight decay, so that the order of decay and update shows (~1e-4 apart)
KW = dict(lr=5e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)


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


@torch.no_grad()
def _rel(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def compare(device: str = "cpu", steps: int = 3) -> dict:
    """Max relative differences (parameters, moments) after `steps` clipped steps, and after a
    state_dict hand-over in each direction followed by one more step."""
    ours_p, ref_p = _params(device), _params(device)
    ours = TritonAdamW(ours_p, **KW)
    ref = torch.optim.AdamW(ref_p, **KW, foreach=False)
    for step in range(steps):
        grads = _grads(step, device)
        _set_grads(ours_p, grads)
        _set_grads(ref_p, grads)
        set_lr(ours, KW["lr"] * (step + 1) / steps)
        set_lr(ref, KW["lr"] * (step + 1) / steps)
        clipped_step(ours, [p.grad for p in ours_p], 5.0)
        torch.nn.utils.clip_grad_norm_(ref_p, 5.0)
        ref.step()
    out = {
        "params": _rel(ours_p, ref_p),
        "exp_avg": _rel([ours.state[p]["exp_avg"] for p in ours_p], [ref.state[p]["exp_avg"] for p in ref_p]),
        "exp_avg_sq": _rel([ours.state[p]["exp_avg_sq"] for p in ours_p], [ref.state[p]["exp_avg_sq"] for p in ref_p]),
        "step_on_host": all(ours.state[p]["step"].device.type == "cpu" for p in ours_p),
    }
    # hand-over, then one more unclipped step each: torch's state into ours (from the per-tensor
    # and from the fused implementation, whose step counts live on the device), ours into torch's
    fused_p = _params(device, 1)
    for x, y in zip(fused_p, ref_p):
        x.data.copy_(y.data)
    fused = torch.optim.AdamW(fused_p, **KW, fused=True)
    fused.load_state_dict(copy.deepcopy(ref.state_dict()))
    takers = {"from_torch": (TritonAdamW, ref), "from_fused": (TritonAdamW, fused), "to_torch": (None, ours)}
    results = {}
    for name, (kind, source) in takers.items():
        ps = _params(device, 1)
        for x, y in zip(ps, ref_p):
            x.data.copy_(y.data)
        opt = TritonAdamW(ps, **KW) if kind is TritonAdamW else torch.optim.AdamW(ps, **KW, foreach=False)
        load_optimizer_state(opt, copy.deepcopy(source.state_dict()))
        results[name] = (ps, opt)
    grads = _grads(steps, device)
    for ps, opt in [*results.values(), (ref_p, ref)]:
        _set_grads(ps, grads)
        opt.step()
    for name, (ps, _opt) in results.items():
        out[name] = _rel(ps, ref_p)
    out["loaded_step_on_host"] = all(s["step"].device.type == "cpu" for s in results["from_fused"][1].state.values())
    out["to_torch_keeps_its_implementation"] = results["to_torch"][1].param_groups[0].get("foreach") is False
    return out


def working_copies_compare(device: str = "cpu", steps: int = 3) -> dict:
    """fp32 masters with bf16 working copies of the matrices (DrafterReplica's bf16 mode): the
    matrices' gradients in bf16 on the copies, clipped steps. Against torch.optim.AdamW on the
    same gradients in fp32: masters and moments (rel), how far each copy is from its master
    rounded to bf16 (in bf16 ulps: 0 on CUDA; the interpreter may truncate), and that the
    vectors (no copy) read their own fp32 gradients."""
    ours_p, ref_p = _params(device), _params(device)
    copies = [p.detach().to(torch.bfloat16) if p.dim() >= 2 else None for p in ours_p]
    ours = TritonAdamW(ours_p, **KW, working_copies=copies)
    ref = torch.optim.AdamW(ref_p, **KW, foreach=False)
    for step in range(steps):
        grads = []
        for p, w, r, g in zip(ours_p, copies, ref_p, _grads(step, device)):
            if w is not None:
                w.grad, p.grad = g.to(torch.bfloat16), None
                grads.append(w.grad)
            else:
                p.grad = g.clone()
                grads.append(p.grad)
            r.grad = grads[-1].float()  # the same values in fp32
        clipped_step(ours, grads, 5.0)
        torch.nn.utils.clip_grad_norm_(ref_p, 5.0)
        ref.step()
    ulps = 0.0
    for p, w in zip(ours_p, copies):
        if w is not None:
            rounded = p.detach().to(torch.bfloat16)
            ulp = torch.finfo(torch.bfloat16).eps * rounded.float().abs().clamp_min(1e-30)
            ulps = max(ulps, float(((w.float() - rounded.float()).abs() / ulp).max()))
    return {
        "masters": _rel(ours_p, ref_p),
        "exp_avg": _rel([ours.state[p]["exp_avg"] for p in ours_p], [ref.state[p]["exp_avg"] for p in ref_p]),
        "copy_ulps_from_rounded_master": ulps,
        "copies": sum(w is not None for w in copies),
    }


def main(args: list[str]) -> dict:
    """The check's result on the device args[0] names (default: the CPU)."""
    device = args[0] if args else "cpu"
    return {**compare(device), "working_copies": working_copies_compare(device)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
