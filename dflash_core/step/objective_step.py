"""The loss of the objective step (objectives.py) for one micro-batch: the teacher's hidden
states at the positions before the labels, the chunked terms beside the drafter's logits, the
position weights, the weighted mean.

The engine runs this step when it warms the teacher (`[engine] teacher = true`): the target then
runs to its final norm and the micro-batch's features carry, after the captured layers' outputs,
the target's final hidden state of every context position (S rows: the target's forward runs
once per context position; the teacher's logits are formed per chunk of block positions beside
the drafter's, from those rows)."""

from __future__ import annotations

import torch

from ..config import DrafterConfig
from ..data.batches import MicroBatch
from ..drafter import FrozenHead
from ..recipes.dspark import dspark_loss, previous_tokens
from .objectives import ObjectiveInputs, chunked_objective_terms, position_weights, weighted_objective_loss


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
    hidden: torch.Tensor,  # [N*B, H] drafter final hidden states
    teacher: torch.Tensor,  # [S, H] target final hidden states
    head: FrozenHead,
    batch: MicroBatch,
    labels: torch.Tensor,  # [N*B]
    decayed: torch.Tensor,  # [N*B] blocks.block_labels' weights
    objective: ObjectiveInputs,
    chunk_size: int,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, argmax hits [N, B], weights [N, B]); block position 0 never counts."""
    if kernel == "triton_fp8":  # the distillation chunks keep their lm_head GEMMs in bf16
        kernel = "triton"
    n = batch.anchors.shape[0]
    b = labels.shape[0] // n
    seq_len = teacher.shape[0]
    # block position k (1..B-1) predicts token a + k; the target's distribution for it is the
    # one it forms at a + k - 1
    k = torch.arange(1, b, device=batch.anchors.device)
    teacher_pos = (batch.anchors.unsqueeze(1) + k - 1).clamp(max=seq_len - 1).reshape(-1)
    rows = hidden.reshape(n, b, -1)[:, 1:].reshape(n * (b - 1), -1)
    row_labels = labels.view(n, b)[:, 1:].reshape(-1)
    teacher_rows = teacher[teacher_pos].to(rows.dtype)
    if drafter.config.recipe == "dspark":  # the Markov bias in the logits, and the confidence head
        weights = decayed.view(n, b)[:, 1:]
        prev = previous_tokens(batch.input_ids, batch.anchors, b).reshape(-1)
        loss, terms, hits = dspark_loss(
            drafter,
            rows,
            teacher_rows,
            head.lm_head_weight,
            prev,
            row_labels,
            weights.reshape(-1),
            objective.mix,
            objective.conf,
            chunk_size,
            kernel,
            b - 1,
        )
    else:
        mixed, terms, hits = chunked_objective_terms(
            rows, teacher_rows, head.lm_head_weight, row_labels, objective.mix, chunk_size, kernel
        )
        weights = position_weights(decayed.view(n, b)[:, 1:], terms[:, 0].view(n, b - 1), objective)
        loss = weighted_objective_loss(mixed, weights.reshape(-1))
    zero = torch.zeros(n, 1, dtype=weights.dtype, device=weights.device)
    correct = torch.cat([torch.zeros(n, 1, dtype=torch.bool, device=hits.device), hits.view(n, b - 1)], dim=1)
    return loss, correct, torch.cat([zero, weights], dim=1)
