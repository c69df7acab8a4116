"""The loss of the objective step (objectives.py) for one micro-batch: the teacher's hidden
states at the positions before the labels, the chunked terms beside the drafter's logits, the
position weights, the weighted mean.

The engine runs this step when it warms the teacher (`[engine] teacher = true`): the target then
runs to its final norm and the micro-batch's features carry, after the captured layers' outputs,
the target's final hidden state of every context position (S rows: the target's forward runs
once per context position; the teacher's logits are formed once per context position where the
blocks need more rows than there are positions, else per chunk of block positions: teacher.py)."""

from __future__ import annotations

import torch

from ..config import DrafterConfig
from ..data.batches import MicroBatch
from ..drafter import FrozenHead
from .blocks import label_positions, previous_tokens
from .inputs import BlockOutputs, RowLossInputs, StepSettings
from .teacher import TeacherLogits


def split_teacher(features: torch.Tensor, cfg: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafter features [..., S, n*H], teacher hidden states [S, H]) of teacher features."""
    width = cfg.num_target_features * cfg.hidden_size
    if features.shape[-1] != width + cfg.hidden_size:
        raise ValueError(
            f"the objective step needs the target's final hidden states after the captured layers "
            f"({width + cfg.hidden_size} feature columns), got {features.shape[-1]}"
        )
    teacher = features[..., width:]
    return features[..., :width], teacher.reshape(-1, cfg.hidden_size)


def objective_loss(
    drafter,
    head: FrozenHead,
    batch: MicroBatch,
    blocks: BlockOutputs,
    teacher: torch.Tensor,  # [S, H] target final hidden states
    settings: StepSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, argmax hits [N, B], weights [N, B]) of the layout's predicting slots (the recipe's
    row_loss, looked up with the settings: the DFlash mix, or DSpark's Markov bias and confidence
    head); a slot before the layout's first predicting one never counts."""
    if settings.objective is None or settings.row_loss is None:
        raise ValueError("the objective step needs an objective and its recipe's row_loss (StepSettings.with_hooks)")
    kernel = settings.kernels.loss
    lm_head = head.lm_head_for(kernel)  # an fp8.Fp8Head for "triton_fp8": the teacher's GEMMs too
    cfg = drafter.config
    labels = blocks.labels
    n = batch.anchors.shape[0]
    b, first = labels.shape[0] // n, cfg.first_slot
    d = b - first
    seq_len = teacher.shape[0]
    # the target's distribution for the token at position p is the one it forms at p - 1
    teacher_pos = (label_positions(batch, b, cfg.block_layout)[:, first:] - 1).clamp(max=seq_len - 1).reshape(-1)
    rows = blocks.hidden.reshape(n, b, -1)[:, first:].reshape(n * d, -1)
    row_labels = labels.view(n, b)[:, first:].reshape(-1)
    teacher_rows = TeacherLogits.at_positions(teacher, teacher_pos, lm_head)
    prev = previous_tokens(batch.input_ids, batch.anchors, d)
    inputs = RowLossInputs(
        rows,
        teacher_rows,
        lm_head,
        prev,
        row_labels,
        blocks.weights.view(n, b)[:, first:],
        settings.objective,
        settings.chunk_size,
        kernel,
    )
    loss, _terms, hits, weights = settings.row_loss(drafter, inputs)
    skipped = torch.zeros(n, first, dtype=weights.dtype, device=weights.device)
    correct = torch.cat([skipped.bool(), hits.view(n, d)], dim=1)
    return loss, correct, torch.cat([skipped, weights], dim=1)
