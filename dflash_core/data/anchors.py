"""Anchor selection: where the blocks of a micro-batch start.

Anchor a is valid iff a and a+1 are loss-masked tokens of the same document (at inference the
anchor is always a generated token and at least one label follows it). A micro-batch has a fixed
number of anchor slots, filled without replacement and returned sorted; unused slots are padding
(anchor 0, valid False).

Choice, when there are more valid positions than slots: first a tiling of every run of valid
positions with a random phase (an anchor every B-1 positions, plus the run's first position), so
that every trainable token is a label of some block; the remaining slots get random other valid
positions. When even the tiling does not fit, one random anchor per equal stratum of the valid
positions (as dense and even as the slots allow).
"""

from __future__ import annotations

import numpy as np


def valid_anchor_positions(doc_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    ok = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    return np.nonzero(ok)[0].astype(np.int64)


def _tiling(candidates: np.ndarray, stride: int, rng: np.random.Generator) -> np.ndarray:
    runs = np.split(candidates, np.nonzero(np.diff(candidates) > 1)[0] + 1)
    picks = []
    for run in runs:
        phase = int(rng.integers(0, stride))
        picks.append(run[phase::stride])
        if phase:
            picks.append(run[:1])
    return np.unique(np.concatenate(picks))


def sample_anchors(
    doc_ids: np.ndarray, loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(anchors int64 [N], valid bool [N]); valid anchors first, sorted."""
    candidates = valid_anchor_positions(doc_ids, loss_mask)
    anchors = np.zeros(num_anchors, dtype=np.int64)
    valid = np.zeros(num_anchors, dtype=bool)
    n = len(candidates)
    if n <= num_anchors:
        chosen = candidates
    else:
        tiles = _tiling(candidates, max(1, block_size - 1), rng)
        if len(tiles) <= num_anchors:
            rest = np.setdiff1d(candidates, tiles, assume_unique=True)
            extra = rng.choice(rest, size=num_anchors - len(tiles), replace=False)
            chosen = np.concatenate([tiles, extra])
        else:
            edges = np.linspace(0, n, num_anchors + 1).astype(np.int64)
            picks = edges[:-1] + (rng.random(num_anchors) * (edges[1:] - edges[:-1])).astype(np.int64)
            chosen = candidates[picks]
    anchors[: len(chosen)] = np.sort(chosen)
    valid[: len(chosen)] = True
    return anchors, valid
