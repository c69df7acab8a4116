"""The DFlash recipe's torch hooks: no heads beyond the backbone; each drafted slot's logits are
the frozen LM head's on its hidden state, so a block is drafted all at once."""

from __future__ import annotations

import torch
from torch import nn


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


class DFlashOps:
    @staticmethod
    def attach_heads(drafter: nn.Module, cfg) -> None:
        """No heads: the backbone and the target's LM head are the drafter."""

    @staticmethod
    def head_keys(markov_head_type: str) -> set[str]:
        return set()

    @staticmethod
    def row_loss(drafter, inputs):
        """(loss, terms [R, 3], hits [R], weights [N, D]) of the predicting rows of N blocks
        (step.inputs.RowLossInputs): the mixed terms beside the drafter's logits, weighted by
        decay or D-PACE."""
        from ..step.objectives import chunked_objective_terms, position_weights, weighted_objective_loss

        objective = inputs.objective
        mixed, terms, hits = chunked_objective_terms(
            inputs.rows,
            inputs.teacher_rows,
            inputs.lm_head,
            inputs.labels,
            objective.mix,
            inputs.chunk_size,
            inputs.kernel,
        )
        n, d = inputs.decayed.shape
        weights = position_weights(inputs.decayed, terms[:, 0].view(n, d), objective)
        return weighted_objective_loss(mixed, weights.reshape(-1)), terms, hits, weights

    @staticmethod
    def draft(drafter, lm_head: torch.Tensor, slots: torch.Tensor, anchor_token: int) -> tuple[list[int], list[float]]:
        """Greedy: each slot's argmax (no confidence head)."""
        return (slots.to(lm_head.dtype) @ lm_head.t()).argmax(dim=-1).tolist(), []

    @staticmethod
    def sample(drafter, lm_head, slots, anchor_token, temperature, generator) -> tuple[list[int], torch.Tensor]:
        """Each slot drawn on its own at `temperature`: (tokens, their distributions [D, V])."""
        q = torch.softmax((slots.to(lm_head.dtype) @ lm_head.t()).float() / temperature, dim=-1)
        return [_sample(row, generator) for row in q], q

    @staticmethod
    def export_fields(cfg, dflash_config: dict) -> dict:
        return {}


OPS = DFlashOps()
