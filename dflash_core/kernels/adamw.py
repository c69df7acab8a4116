"""AdamW as one Triton kernel per parameter tensor, with gradient clipping folded in.

Why not torch's fused AdamW: at drafter sizes (about a billion fp32 parameters) the step is
memory-bound, 28 bytes moved per parameter, so the only question is how close a kernel gets to
the copy bandwidth. torch's fused kernel stays well below it; a compiled foreach step gets closer
but pays a long cold compile in every process, on every drafter GPU. A plain elementwise Triton
kernel gets as close and needs about a second of JIT. Clipping by the global norm folds in too:
torch's clip_grad_norm_ rescales every gradient in place (another full read and write of the
gradients); here the kernel reads the clip coefficient from device memory and scales each
gradient as it loads it, so there is no host sync either. `python -m bench.optimizer` compares
them (docs/performance.md).

Working copies: a parameter may have a bf16 working copy (the tensor the model computes with;
DrafterReplica keeps one per weight matrix). The kernel then reads the gradient from the working
copy when the master (fp32) has none, and writes the updated master rounded to bf16 into the copy
in the same pass: the step moves the same 28 bytes per parameter (a bf16 gradient read, a bf16
write), and the forward need not cast every weight matrix, nor the backward every gradient.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps added to
the corrected sqrt), in fp32; its state uses AdamW's names ("step", "exp_avg", "exp_avg_sq"),
so checkpoints from either optimizer load into the other.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    grad_scale_ptr,
    working_ptr,
    n_elements,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction1,
    bias_correction2_sqrt,
    HAS_WORKING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n_elements
    param = tl.load(param_ptr + offsets, mask=in_range)
    grad = tl.load(grad_ptr + offsets, mask=in_range).to(tl.float32) * tl.load(grad_scale_ptr)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=in_range)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=in_range)

    param = param * (1.0 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - (lr / bias_correction1) * exp_avg / denom

    tl.store(param_ptr + offsets, param, mask=in_range)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=in_range)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=in_range)
    if HAS_WORKING:  # round to nearest even, as tensor.to(torch.bfloat16)
        tl.store(working_ptr + offsets, param.to(working_ptr.dtype.element_ty), mask=in_range)


# torch.optim.AdamW's implementation switches: a loaded torch state brings them, they mean nothing here
TORCH_ONLY_GROUP_KEYS = (
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


class TritonAdamW(torch.optim.Optimizer):
    """AdamW over contiguous fp32 parameters.

    working_copies (optional, aligned with the parameters in order; None where a parameter has
    none): a bf16/fp16 tensor of the parameter's shape that every step overwrites with the
    updated parameter. A parameter's gradient is its own .grad (fp32) when set, else its working
    copy's .grad (any float dtype; read in fp32).

    step(grad_scale=t) multiplies every gradient by the one-element fp32 device tensor t as the
    kernel loads it (the clip coefficient); p.grad itself is left as it was. Without t the
    kernel reads a cached 1.0, so one compiled kernel serves both (nothing left to compile in a
    job that does not clip)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        working_copies=None,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.block, self.num_warps = block, num_warps  # launch settings, not state
        self._ones: dict[torch.device, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(f"TritonAdamW needs contiguous fp32 parameters, got {p.dtype} {tuple(p.shape)}")
                if p.numel() >= 2**31:
                    raise ValueError(f"parameter of {p.numel()} elements: over the kernel's int32 offsets")
        params = [p for group in self.param_groups for p in group["params"]]
        working_copies = list(working_copies) if working_copies is not None else [None] * len(params)
        if len(working_copies) != len(params):
            raise ValueError(f"{len(working_copies)} working copies for {len(params)} parameters")
        self.working_copies: dict[torch.Tensor, torch.Tensor] = {}  # master -> its working copy
        for p, w in zip(params, working_copies):
            if w is None:
                continue
            if (
                w.shape != p.shape
                or w.device != p.device
                or not w.is_contiguous()
                or w.dtype not in (torch.bfloat16, torch.float16)
            ):
                raise ValueError(
                    f"a working copy must be a contiguous bf16/fp16 tensor of its parameter's shape and "
                    f"device: got {w.dtype} {tuple(w.shape)} on {w.device} for {tuple(p.shape)} on {p.device}"
                )
            self.working_copies[p] = w

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # floats, always: Triton types a Python int argument as i32 (and an int 1 as a
            # constant), which would be another kernel to compile in the middle of a job
            lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            beta1, beta2 = (float(b) for b in group["betas"])
            work = []  # (param, its gradient, its working copy): the host's per-tensor work in one pass
            for p in group["params"]:
                working = self.working_copies.get(p)
                grad = p.grad if p.grad is not None or working is None else working.grad
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # the step count stays on the host: the bias corrections need no device read
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                work.append((p, grad if grad.is_contiguous() else grad.contiguous(), working))
            if not work:
                continue
            steps = [self.state[p]["step"] for p, _, _ in work]
            torch._foreach_add_(steps, 1.0)  # one call: this loop runs on the drafter's thread, holding the GIL
            corrections: dict[float, tuple[float, float]] = {}
            with triton_launch_device(work[0][0].device):
                for (p, grad, working), step_tensor in zip(work, steps, strict=True):
                    step = float(step_tensor)
                    if step not in corrections:
                        corrections[step] = (1.0 - beta1**step, math.sqrt(1.0 - beta2**step))
                    bias_correction1, bias_correction2_sqrt = corrections[step]
                    state = self.state[p]
                    n = p.numel()
                    _adamw_kernel[(triton.cdiv(n, self.block),)](
                        p,
                        grad,
                        state["exp_avg"],
                        state["exp_avg_sq"],
                        grad_scale if grad_scale is not None else self._one(p.device),
                        working if working is not None else p,
                        n,
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        bias_correction1,
                        bias_correction2_sqrt,
                        HAS_WORKING=working is not None,
                        BLOCK=self.block,
                        num_warps=self.num_warps,
                    )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients and their working copies' (where the kernel reads them)."""
        super().zero_grad(set_to_none)
        for working in self.working_copies.values():
            working.grad = None

    def _one(self, device: torch.device) -> torch.Tensor:
        if device not in self._ones:
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]

    def load_state_dict(self, state_dict) -> None:
        """Loads torch.optim.AdamW's state too (checkpoints written with torch's optimizer resume here)."""
        for group in state_dict["param_groups"]:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"optimizer state saved with {flag}=True: TritonAdamW implements neither")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key in TORCH_ONLY_GROUP_KEYS:
                group.pop(key, None)
        # torch's fused AdamW keeps "step" on the device: ours stays on the host
        for state in self.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().to("cpu", torch.float32)
