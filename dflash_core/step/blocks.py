"""From a packed micro-batch to drafter blocks: inputs, positions, labels and loss weights.

Block j starts at anchor a_j: its input tokens are [token(a_j), MASK x (B-1)] at positions
pos(a_j) + 0..B-1 (positions restart per document). Block position k = 1..B-1 predicts token
a_j + k with weight exp(-(k-1)/gamma) if that token is loss-masked and in the anchor's document;
position 0 (the anchor itself) never counts, nor does any position of a padding block.
"""

from __future__ import annotations

import torch

from ..data.batches import MicroBatch


def block_inputs(batch: MicroBatch, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [N*B], block position ids [N*B])."""
    n = batch.anchors.shape[0]
    ids = torch.full((n, block_size), mask_token_id, dtype=batch.input_ids.dtype, device=batch.input_ids.device)
    ids[:, 0] = batch.input_ids[batch.anchors]
    offsets = torch.arange(block_size, device=batch.anchors.device)
    positions = batch.position_ids[batch.anchors].unsqueeze(1) + offsets
    return ids.reshape(-1), positions.reshape(-1)


def position_decay(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] weights: 0 at k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_labels(
    batch: MicroBatch, block_size: int, gamma: float, decay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [N*B], weights float32 [N*B]). decay: position_decay(block_size, gamma) when
    the caller keeps it in a tensor of its own (a recorded step reads it from a fixed buffer)."""
    seq_len = batch.input_ids.shape[0]
    offsets = torch.arange(block_size, device=batch.anchors.device)
    target_pos = batch.anchors.unsqueeze(1) + offsets  # [N, B]
    in_range = target_pos < seq_len
    target_pos = target_pos.clamp(max=seq_len - 1)
    labels = batch.input_ids[target_pos]
    same_doc = batch.doc_ids[target_pos] == batch.doc_ids[batch.anchors].unsqueeze(1)
    valid = in_range & same_doc & batch.loss_mask[target_pos] & batch.anchor_valid.unsqueeze(1)
    if decay is None:
        decay = position_decay(block_size, gamma, batch.anchors.device)
    weights = decay * valid
    return labels.reshape(-1), weights.reshape(-1)


def expected_acceptance_length(position_accuracy: list[float]) -> float:
    """sum_k prod_{i<=k} acc_i over block positions, with position 0 (the anchor, always
    accepted) counted as accuracy 1: the same scale as the evaluated acceptance length tau."""
    total, run = 0.0, 1.0
    for acc in position_accuracy:
        run *= acc
        total += run
    return total


__all__ = ["block_inputs", "block_labels", "position_decay", "expected_acceptance_length"]
