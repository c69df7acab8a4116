"""One drafter micro-step: micro-batch + target features -> weighted loss and statistics (how
it runs: step.inputs.StepSettings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.batches import MicroBatch
from ..drafter import DFlashDrafter, FrozenHead
from .attention import DenseAttention, inference_mask, training_attention
from .blocks import block_inputs, block_labels
from .inputs import EAGER, BlockOutputs, StepKernels, StepSettings
from .loss import chunked_lm_head_loss
from .objective_step import objective_loss, split_teacher

__all__ = ["EAGER", "MicroStepResult", "StepKernels", "StepSettings", "micro_step"]


@dataclass
class MicroStepResult:
    loss: torch.Tensor  # fp32 scalar (graph attached when training)
    correct: torch.Tensor  # bool [N, B]
    weights: torch.Tensor  # fp32 [N, B]


def step_attention(
    batch: MicroBatch, block_size: int, attention: str, kernels: StepKernels = EAGER, sliding_window: int | None = None
):
    """The attention callable of one micro-batch, built as the step builds it."""
    return training_attention(
        attention,
        batch.doc_ids,
        batch.anchors,
        batch.anchor_valid,
        batch.input_ids.shape[0],
        block_size,
        compiled=kernels.attention,
        compiled_mask=kernels.mask,
        q_splits=kernels.q_splits,
        sliding_window=sliding_window,
    )


def block_embeddings(head: FrozenHead, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's input for block tokens ids [Q]: [1, Q, H]. One lookup in the frozen table,
    which holds the target's embedding with its scale folded in (TargetModel.frozen_head), so it
    equals what the serving loop feeds the drafter (tests/test_serving_parity.py)."""
    return torch.nn.functional.embedding(ids, head.embed_weight).unsqueeze(0)


def drafter_forward(
    drafter: DFlashDrafter,
    head: FrozenHead,
    batch: MicroBatch,
    features: torch.Tensor,
    attend,
    kernels: StepKernels = EAGER,
) -> torch.Tensor:
    """Training-time forward of all blocks: final hidden states [Q, H]."""
    cfg = drafter.config
    ids, positions = block_inputs(batch, cfg.block_size, cfg.mask_token_id)
    embeds = block_embeddings(head, ids)
    feats = features.unsqueeze(0) if features.dim() == 2 else features
    if kernels.forward is not None:
        return kernels.forward(embeds, feats, positions, batch.position_ids, attend)[0]
    if kernels.layer is not None:
        return drafter(embeds, feats, positions, batch.position_ids, attend, kernels.layer)[0]
    return drafter(embeds, feats, positions, batch.position_ids, attend)[0]


def micro_step(
    drafter: DFlashDrafter,
    head: FrozenHead,
    batch: MicroBatch,
    features: torch.Tensor,
    settings: StepSettings,
    decay: torch.Tensor | None = None,
) -> MicroStepResult:
    """decay: the loss's position weights (blocks.position_decay of settings.gamma) as a tensor
    the caller holds, else computed from gamma. With settings.objective the step is the objective
    step (objective_step.py; the features then end with the target's final hidden states), else
    the DFlash block CE."""
    cfg = drafter.config
    kernels = settings.kernels
    if settings.objective is not None:
        drafter_features, teacher = split_teacher(features, cfg)
    else:
        drafter_features, teacher = features, None
    hidden = drafter_forward(
        drafter,
        head,
        batch,
        drafter_features,
        step_attention(batch, cfg.block_size, settings.attention, kernels, cfg.sliding_window),
        kernels,
    )
    labels, weights = block_labels(batch, cfg.block_size, settings.gamma, decay, cfg.block_layout)
    if teacher is not None:
        loss, correct, weights = objective_loss(
            drafter, head, batch, BlockOutputs(hidden, labels, weights), teacher, settings
        )
        return MicroStepResult(loss, correct, weights)
    n, b, first = batch.anchors.shape[0], cfg.block_size, cfg.first_slot

    def predicting(t: torch.Tensor) -> torch.Tensor:
        # a fill-in block's slot 0 (the anchor's own token) never counts: no logits for it, 1/B
        # of the lm_head GEMMs and CE passes saved; the loss is the same (its weight is 0)
        return t.reshape(n, b, *t.shape[1:])[:, first:].reshape(n * (b - first), *t.shape[1:])

    loss, correct = chunked_lm_head_loss(
        predicting(hidden),
        head.lm_head_for(kernels.loss),
        predicting(labels),
        predicting(weights),
        settings.chunk_size,
        kernels.loss,
    )
    skipped = torch.zeros(n, first, dtype=torch.bool, device=correct.device)
    return MicroStepResult(loss, torch.cat([skipped, correct.view(n, b - first)], dim=1), weights.view(n, b))


def inference_block_forward(
    drafter: DFlashDrafter,
    head: FrozenHead,
    context_features: torch.Tensor,  # [T, n*H] target features of positions 0..T-1 (< anchor)
    block_ids: torch.Tensor,  # [B] anchor token then MASK tokens
    anchor_position: int,
) -> torch.Tensor:
    """Inference-style forward of one block (KV-cache-like: context is all the past, nothing is
    masked). Returns the final hidden states [B, H]."""
    b = block_ids.shape[0]
    device = block_ids.device
    embeds = block_embeddings(head, block_ids)
    block_pos = torch.arange(anchor_position, anchor_position + b, device=device)
    ctx_pos = torch.arange(context_features.shape[0], device=device)
    mask = inference_mask(context_features.shape[0], b, drafter.config.sliding_window, device)
    return drafter(embeds, context_features.unsqueeze(0), block_pos, ctx_pos, DenseAttention(mask))[0]
