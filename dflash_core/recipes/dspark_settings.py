"""DSpark's public recipe as plain values (no torch: the daemon validates its config before
it imports torch). The numbers are DeepSpec's `config/dspark/dspark_qwen3_8b.py`: block 7
anchor-first, loss_decay_gamma 4 on every term, ce_loss_alpha 0.1, l1_loss_alpha 0.9 (its L1 is
sum |p_d - p_t| = 2 TV), confidence_head_alpha 1.0, markov_rank 256."""

from __future__ import annotations

from .base import ANCHOR_FIRST, Recipe

DSPARK_BLOCK_SIZE = 7  # the public Qwen3 DSpark configs
DSPARK_MARKOV_RANK = 256  # the public Qwen3-8B config
DSPARK_GAMMA = 4.0  # loss_decay_gamma: exp(-k / 4) over the block's slots, on all three terms
DSPARK_LOSS = {"ce": 0.1, "l1": 0.9, "conf": 1.0}

DSPARK = Recipe(
    name="dspark",
    layout=ANCHOR_FIRST,
    block_size=DSPARK_BLOCK_SIZE,
    gamma=DSPARK_GAMMA,
    loss=DSPARK_LOSS,
    teacher=True,
    heads=True,
    architecture="DSparkDraftModel",
    ops="dflash_core.recipes.dspark",
    settings=("markov_rank", "markov_head_type"),
    projector="dspark",
)


def default_markov_rank(vocab_size: int, hidden_size: int) -> int:
    """The public rank, capped for small vocabularies and widths: a rank at or above either
    would be no low-rank bias at all."""
    return max(1, min(DSPARK_MARKOV_RANK, vocab_size // 4, hidden_size))
