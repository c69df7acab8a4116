"""From a packed micro-batch to drafter blocks: inputs, positions, labels and loss weights.

Block j starts at anchor a_j: its input tokens are [token(a_j), MASK x (B-1)] at positions
pos(a_j) + 0..B-1 (positions restart per document). Which token a slot predicts is the block
layout's (recipes.base.Layout), with f its first predicting slot:
  fill_in (f = 1): slot k = 1..B-1 predicts token a_j + k; slot 0 never counts;
  anchor_first (f = 0): slot k = 0..B-1 predicts token a_j + k + 1.
A slot's weight is exp(-(k - f)/gamma) if its label is loss-masked and in the anchor's document
(anchor_first: and every earlier slot's label is, the contiguous prefix DeepSpec supervises);
no slot of a padding block counts.
"""

from __future__ import annotations

import torch

from ..data.batches import MicroBatch
from ..recipes.base import FILL_IN, Layout


def block_inputs(batch: MicroBatch, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [N*B], block position ids [N*B])."""
    n = batch.anchors.shape[0]
    ids = torch.full((n, block_size), mask_token_id, dtype=batch.input_ids.dtype, device=batch.input_ids.device)
    ids[:, 0] = batch.input_ids[batch.anchors]
    offsets = torch.arange(block_size, device=batch.anchors.device)
    positions = batch.position_ids[batch.anchors].unsqueeze(1) + offsets
    return ids.reshape(-1), positions.reshape(-1)


def position_decay(block_size: int, gamma: float, device=None, layout: Layout = FILL_IN) -> torch.Tensor:
    """[B] weights: exp(-(k - f)/gamma) at the predicting slots k >= f, 0 before them."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - layout.first_slot) / gamma)
    w[: layout.first_slot] = 0.0
    return w


def label_positions(batch: MicroBatch, block_size: int, layout: Layout = FILL_IN) -> torch.Tensor:
    """[N, B]: the position of the token each slot predicts (unclamped)."""
    offsets = torch.arange(block_size, device=batch.anchors.device) + layout.label_offset(0)
    return batch.anchors.unsqueeze(1) + offsets


def block_labels(
    batch: MicroBatch,
    block_size: int,
    gamma: float,
    decay: torch.Tensor | None = None,
    layout: Layout = FILL_IN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [N*B], weights float32 [N*B]). decay: position_decay(block_size, gamma,
    layout=layout) when the caller keeps it in a tensor of its own (a recorded step reads it from
    a fixed buffer)."""
    seq_len = batch.input_ids.shape[0]
    target_pos = label_positions(batch, block_size, layout)  # [N, B]
    in_range = target_pos < seq_len
    target_pos = target_pos.clamp(max=seq_len - 1)
    labels = batch.input_ids[target_pos]
    same_doc = batch.doc_ids[target_pos] == batch.doc_ids[batch.anchors].unsqueeze(1)
    valid = in_range & same_doc & batch.loss_mask[target_pos] & batch.anchor_valid.unsqueeze(1)
    if layout.prefix_mask:
        first = layout.first_slot
        valid = torch.cat([valid[:, :first], valid[:, first:].int().cumprod(dim=1).bool()], dim=1)
    if decay is None:
        decay = position_decay(block_size, gamma, batch.anchors.device, layout)
    weights = decay * valid
    return labels.reshape(-1), weights.reshape(-1)


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, drafted: int) -> torch.Tensor:
    """[N, D]: the token before each of a block's D predicted ones, a + i for i = 0..D-1 in
    either layout (the anchor first): what a Markov head conditions on."""
    k = torch.arange(drafted, device=anchors.device)
    return input_ids[(anchors.unsqueeze(1) + k).clamp(max=input_ids.shape[0] - 1)]


def expected_acceptance_length(position_accuracy: list[float]) -> float:
    """sum_k prod_{i<=k} acc_i over block positions, with position 0 (the anchor, always
    accepted) counted as accuracy 1: the same scale as the evaluated acceptance length tau."""
    total, run = 0.0, 1.0
    for acc in position_accuracy:
        run *= acc
        total += run
    return total


__all__ = [
    "block_inputs",
    "block_labels",
    "expected_acceptance_length",
    "label_positions",
    "position_decay",
    "previous_tokens",
]
