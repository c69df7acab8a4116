"""One drafter replica: its device, fp32 master weights, frozen head and optimizer."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from ..config import DrafterConfig
from ..data.batches import MicroBatch
from ..drafter import DFlashDrafter, run_layer
from ..loss import LOSS_KERNELS
from ..train_step import FrozenHead, MicroStepResult, StepKernels, micro_step
from .optim import clipped_step, set_lr

COMPILE_SCOPES = ("attention", "layer", "step")
# the engine's choice among loss.LOSS_KERNELS: "compiled" falls back to "eager" where nothing is
# compiled; "triton" (CUDA) is the two-pass CE kernel of ce_triton.py, no compiled loss graph
LOSS_KERNEL_CHOICES = tuple(k for k in LOSS_KERNELS if k != "eager")


@dataclass
class StepAccumulator:
    """Per-step statistics kept on the device (one host sync per step, when read)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor  # [B] counts of right predictions among weighted positions
    counted: torch.Tensor  # [B] weighted positions
    context_tokens: int = 0
    micro_batches: int = 0
    extra: dict = field(default_factory=dict)


class DrafterReplica:
    def __init__(self, index: int, cfg: DrafterConfig, device: str, head: FrozenHead, *, attention: str, compiled: bool,
                 compute_dtype: torch.dtype, gamma: float, chunk_size: int, compile_scope: str = "layer",
                 flex_q_splits: int = 1, loss_kernel: str = "compiled"):
        """compile_scope (when compiled): "attention" compiles flex_attention alone; "layer"
        compiles one decoder layer (flex inside; the same code serves every layer), the BlockMask
        construction and the lm_head + CE chunks; "step" compiles the whole drafter forward
        instead of one layer (a cold compile several times longer)."""
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {compile_scope!r}")
        if loss_kernel not in LOSS_KERNEL_CHOICES:
            raise ValueError(f"loss_kernel must be one of {LOSS_KERNEL_CHOICES}, got {loss_kernel!r}")
        if loss_kernel == "triton" and torch.device(device).type != "cuda":
            raise ValueError(f"loss_kernel 'triton' needs a CUDA device, got {device!r}")
        self.index = index
        self.device = torch.device(device)
        self.config = cfg
        with torch.device(self.device):  # allocate and default-init on the device, not the CPU
            self.drafter = DFlashDrafter(cfg)  # fp32 master weights
        self.head = head.to(self.device, compute_dtype)
        self.attention = attention
        self.compute_dtype = compute_dtype
        self.gamma = gamma
        self.chunk_size = chunk_size
        self.optimizer: torch.optim.Optimizer | None = None
        self.kernels = _step_kernels(self.drafter, attention, compiled, compile_scope, flex_q_splits, loss_kernel)
        self.params: list[torch.nn.Parameter] = list(self.drafter.parameters())  # fixed for the replica's life

    def grads(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def autocast(self):
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def new_accumulator(self) -> StepAccumulator:
        b = self.config.block_size
        z = lambda *s: torch.zeros(*s, dtype=torch.float32, device=self.device)  # noqa: E731
        return StepAccumulator(z(()), z(b), z(b))

    def forward_backward(self, batch: MicroBatch, features: torch.Tensor, loss_scale: float, acc: StepAccumulator) -> MicroStepResult:
        """Loss and gradients of one micro-batch; gradients accumulate into .grad."""
        self.drafter.train()
        with self.autocast():
            res = micro_step(
                self.drafter, self.head, batch, features, attention=self.attention, gamma=self.gamma,
                chunk_size=self.chunk_size, kernels=self.kernels,
            )
        (res.loss * loss_scale).backward()
        with torch.no_grad():
            counted = res.weights > 0
            acc.loss_sum += res.loss.detach()
            acc.correct += (res.correct & counted).sum(0).float()
            acc.counted += counted.sum(0).float()
        acc.micro_batches += 1
        return res

    def clip_and_step(self, max_norm: float, lr: float) -> torch.Tensor:
        set_lr(self.optimizer, lr)
        norm = clipped_step(self.optimizer, self.params, max_norm)
        self.zero_grad()
        return norm

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in self.drafter.named_parameters():
            p.copy_(state[name].to(p.device, p.dtype))


def _step_kernels(drafter: DFlashDrafter, attention: str, compiled: bool, scope: str, q_splits: int,
                  loss_kernel: str) -> StepKernels:
    # Compiled functions, not compiled modules: evaluation calls the eager drafter at other shapes.
    fused = compiled and scope in ("layer", "step")
    loss = "triton" if loss_kernel == "triton" else ("compiled" if fused else "eager")
    if not compiled:
        return StepKernels(q_splits=q_splits, loss=loss)
    return StepKernels(
        attention=attention == "flex" and scope == "attention",  # otherwise compiled with the layer/forward
        forward=torch.compile(drafter.forward, dynamic=False) if scope == "step" else None,
        layer=_compiled_run_layer() if scope == "layer" else None,
        mask=fused and attention == "flex",
        loss=loss,
        q_splits=q_splits,
    )


@functools.cache
def _compiled_run_layer():
    """One process-wide compiled layer function: every layer of every replica shares its code
    (one graph per device, since guards include the device)."""
    return torch.compile(run_layer, dynamic=False)
