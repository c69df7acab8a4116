"""What a micro-step takes besides its drafter, frozen head and micro-batch: how it runs
(StepSettings: the attention, the loss's position weights and chunking, the compiled parts, the
objective and the recipe's loss hook); what its loss reads of the blocks after the forward
(BlockOutputs); and what the recipe's loss hook reads of their predicting rows (RowLossInputs).

A replica builds its StepSettings once; the recipe's hook is looked up then (`with_hooks`), never
per step: the step runs eagerly as often as it is recorded as a CUDA graph (engine/step_graph.py),
and every tensor it reads is the caller's, as before."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DrafterConfig
from .objectives import ObjectiveInputs
from .teacher import Head, TeacherLogits


@dataclass(frozen=True)
class StepKernels:
    """Which parts of the step run compiled (same math either way; tests compare them).

    attention: flex_attention compiled on its own (off when a compiled forward or layer
    includes it); forward: a compiled `drafter.forward`; layer: a compiled `run_layer`; mask:
    BlockMask built by a compiled kernel (no [Q, KV] grid); loss: how the lm_head + CE chunks run
    (loss.LOSS_KERNELS: "eager", "compiled", "triton")."""

    attention: bool = False
    forward: Callable | None = None
    layer: Callable | None = None
    mask: bool = False
    loss: str = "eager"
    q_splits: int = 1  # flex only: queries as this many batch entries (FlexAttention.q_splits)


EAGER = StepKernels()


@dataclass(frozen=True)
class BlockOutputs:
    """A micro-batch's N blocks of B slots after the drafter's forward, as the loss reads them."""

    hidden: torch.Tensor  # [N*B, H] drafter final hidden states
    labels: torch.Tensor  # [N*B]
    weights: torch.Tensor  # [N*B] blocks.block_labels' position weights


@dataclass(frozen=True)
class RowLossInputs:
    """The predicting rows of N blocks of D predicting positions each (R = N * D rows), as a
    recipe's `row_loss` hook reads them."""

    rows: torch.Tensor  # [R, H] drafter final hidden states
    teacher_rows: torch.Tensor | TeacherLogits  # [R, H] target final hidden states before each label, or their logits
    lm_head: Head  # [V, H] the frozen LM head, an fp8.Fp8Head for the kernel "triton_fp8"
    prev: torch.Tensor  # [N, D] the true token before each label
    labels: torch.Tensor  # [R]
    decayed: torch.Tensor  # [N, D] blocks.block_labels' position weights
    objective: ObjectiveInputs  # the job's mix, confidence weight and D-PACE settings
    chunk_size: int  # rows per chunk of the logits
    kernel: str  # how the chunks run (objectives.logit_terms_function)


# (drafter, rows) -> (loss, terms [R, 3], hits [R], weights [N, D]): the recipe's row_loss
RowLoss = Callable[[Any, RowLossInputs], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StepSettings:
    """How a replica's micro-steps run. gamma may change between jobs (the position decay);
    objective, when set, makes the step the objective step (objective_step.py: the features then
    end with the target's final hidden states) and its loss the recipe's row_loss, else the
    DFlash block CE."""

    attention: str  # step.attention's name: "dense", "flex", ...
    gamma: float  # the position weights' decay constant
    chunk_size: int  # rows per chunk of the lm_head + loss
    kernels: StepKernels = EAGER
    objective: ObjectiveInputs | None = None
    row_loss: RowLoss | None = None  # the recipe's, looked up once (with_hooks)

    def with_hooks(self, cfg: DrafterConfig) -> StepSettings:
        """These settings with the hooks of cfg's recipe, looked up here, once."""
        return dataclasses.replace(self, row_loss=cfg.recipe_spec.hooks().row_loss)
