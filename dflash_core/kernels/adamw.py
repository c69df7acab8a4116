"""AdamW as one Triton kernel launch over all parameter tensors of a kind, with gradient
clipping folded in.

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

One launch, not one per tensor: the launch is the host's part of the step, and it runs on a
drafter thread that holds the GIL while it launches (one process drives every GPU of a host).
Every program updates BLOCK elements of one tensor, found through a table of the tensors'
addresses; tensors are grouped by kind (gradient dtype, working copy dtype), so a drafter's step
is two or three launches instead of one per tensor, with the same memory traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device

BLOCK = 1024
NUM_WARPS = 4


# a launch's tensor table: one int64 row per tensor, the addresses of its parameter, gradient,
# exp_avg, exp_avg_sq and working copy (0: none), then its number of elements
_NUMEL = 5


@triton.jit
def _address(raw, TYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A table entry as a pointer. ALIGNED (checked on the host): every address of the launch is
    a multiple of 16 bytes, which lets the compiler vectorize the loads and stores, as it does for
    a tensor passed as a kernel argument."""
    if ALIGNED:
        raw = tl.multiple_of(raw, 16)
    return raw.to(tl.pointer_type(TYPE))


@triton.jit
def _adamw_block(
    row,
    offsets,
    n_elements,
    grad_scale,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction1,
    bias_correction2_sqrt,
    GRAD_TYPE: tl.constexpr,
    WORKING_TYPE: tl.constexpr,
    HAS_WORKING: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
):
    param_ptr = _address(tl.load(row + 0), tl.float32, ALIGNED)
    grad_ptr = _address(tl.load(row + 1), GRAD_TYPE, ALIGNED)
    exp_avg_ptr = _address(tl.load(row + 2), tl.float32, ALIGNED)
    exp_avg_sq_ptr = _address(tl.load(row + 3), tl.float32, ALIGNED)
    in_range = offsets < n_elements if MASKED else None
    param = tl.load(param_ptr + offsets, mask=in_range)
    grad = tl.load(grad_ptr + offsets, mask=in_range).to(tl.float32) * grad_scale
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
        working_ptr = _address(tl.load(row + 4), WORKING_TYPE, ALIGNED)
        tl.store(working_ptr + offsets, param.to(WORKING_TYPE), mask=in_range)


@triton.jit
def _adamw_kernel(
    table_ptr,
    block_tensor_ptr,
    block_start_ptr,
    grad_scale_ptr,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction1,
    bias_correction2_sqrt,
    GRAD_TYPE: tl.constexpr,
    WORKING_TYPE: tl.constexpr,
    HAS_WORKING: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per BLOCK elements of one tensor: which tensor and where, from the launch's tables
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_tensor_ptr + pid).to(tl.int64) * 6
    n_elements = tl.load(row + 5)
    start = tl.multiple_of(tl.load(block_start_ptr + pid), BLOCK)
    offsets = start + tl.arange(0, BLOCK)
    scale = tl.load(grad_scale_ptr)
    # a whole block (all but a tensor's last, when its size is not a multiple of BLOCK) needs no
    # mask: unmasked accesses vectorize without knowing the tensor's size
    if start + BLOCK <= n_elements:
        _adamw_block(
            row, offsets, n_elements, scale, lr, beta1, beta2, eps, weight_decay, bias_correction1,
            bias_correction2_sqrt, GRAD_TYPE, WORKING_TYPE, HAS_WORKING, ALIGNED, False,
        )  # fmt: skip
    else:
        _adamw_block(
            row, offsets, n_elements, scale, lr, beta1, beta2, eps, weight_decay, bias_correction1,
            bias_correction2_sqrt, GRAD_TYPE, WORKING_TYPE, HAS_WORKING, ALIGNED, True,
        )  # fmt: skip


_TRITON_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _aligned(rows: Sequence[tuple[int, ...]]) -> bool:
    return all(address % 16 == 0 for row in rows for address in row[:_NUMEL])


class _Launch:
    """One kernel launch over tensors of one kind (gradient dtype, working copy dtype): the
    tensor table, and per program the tensor it updates and where in it it starts. The table
    is rebuilt only when an address changes (a recorded step's gradients never move; eager ones
    may); the block tables depend on the sizes alone."""

    def __init__(self, rows: Sequence[tuple[int, ...]], block: int, device: torch.device):
        self.key = tuple(rows)
        self.aligned = _aligned(rows)
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        numel = self.table[:, _NUMEL]
        blocks = (numel + block - 1) // block
        self.programs = int(blocks.sum())
        self.block_tensor = torch.repeat_interleave(torch.arange(len(rows), device=device, dtype=torch.int32), blocks)
        first = torch.cumsum(blocks, 0) - blocks  # each tensor's first program
        index = torch.arange(self.programs, device=device, dtype=torch.int64)
        self.block_start = (index - first.repeat_interleave(blocks)) * block

    def same_sizes(self, rows: Sequence[tuple[int, ...]]) -> bool:
        """The same sizes and alignment: only the addresses may change."""
        return (
            len(rows) == len(self.key)
            and all(a[_NUMEL] == b[_NUMEL] for a, b in zip(rows, self.key))
            and _aligned(rows) == self.aligned
        )

    def retarget(self, rows: Sequence[tuple[int, ...]]) -> None:
        """New addresses, the same sizes: only the table changes."""
        self.key = tuple(rows)
        self.table.copy_(torch.tensor(rows, dtype=torch.int64))


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
        self._launches: dict[tuple, _Launch] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(f"TritonAdamW needs contiguous fp32 parameters, got {p.dtype} {tuple(p.shape)}")
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
            # per launch kind: (param, gradient, working copy) of each tensor; the host's work is
            # per tensor only in building these lists, since it runs on a drafter thread holding the GIL
            kinds: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
            steps = []
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
                steps.append(state["step"])
                grad = grad if grad.is_contiguous() else grad.contiguous()
                kind = (grad.dtype, None if working is None else working.dtype, float(state["step"]) + 1)
                kinds.setdefault(kind, []).append((p, grad, working))
            if not steps:
                continue
            torch._foreach_add_(steps, 1.0)
            for (grad_dtype, working_dtype, step), members in kinds.items():
                device = members[0][0].device
                rows = [
                    (
                        p.data_ptr(),
                        g.data_ptr(),
                        self.state[p]["exp_avg"].data_ptr(),
                        self.state[p]["exp_avg_sq"].data_ptr(),
                        w.data_ptr() if w is not None else 0,
                        p.numel(),
                    )
                    for p, g, w in members
                ]
                launch = self._launches.get((device, grad_dtype, working_dtype))
                if launch is None or not launch.same_sizes(rows):
                    launch = self._launches[(device, grad_dtype, working_dtype)] = _Launch(rows, self.block, device)
                elif launch.key != tuple(rows):
                    launch.retarget(rows)
                with triton_launch_device(device):
                    _adamw_kernel[(launch.programs,)](
                        launch.table,
                        launch.block_tensor,
                        launch.block_start,
                        grad_scale if grad_scale is not None else self._one(device),
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        1.0 - beta1**step,
                        math.sqrt(1.0 - beta2**step),
                        GRAD_TYPE=_TRITON_TYPES[grad_dtype],
                        WORKING_TYPE=_TRITON_TYPES[working_dtype or torch.float32],
                        HAS_WORKING=working_dtype is not None,
                        ALIGNED=launch.aligned,
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
