"""DSpark's public defaults as plain values (no torch: the daemon validates its config before
it imports torch)."""

from __future__ import annotations

import math

DSPARK_BLOCK_SIZE = 7  # the public Qwen3 DSpark configs
DSPARK_MARKOV_RANK = 256  # the public Qwen3-8B config
# the public recipe weights every supervised position alike (SpecForge's loss_decay_gamma is
# None for DSpark): an infinite gamma makes exp(-(k-1)/gamma) = 1
DSPARK_GAMMA = math.inf
DSPARK_LOSS = {"ce": 0.1, "tv": 0.9, "conf": 1.0}


def default_markov_rank(vocab_size: int, hidden_size: int) -> int:
    """The public rank, capped for small vocabularies and widths: a rank at or above either
    would be no low-rank bias at all."""
    return max(1, min(DSPARK_MARKOV_RANK, vocab_size // 4, hidden_size))
