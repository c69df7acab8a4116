"""Anchor selection: where the blocks of a micro-batch start.

Anchor a is valid iff a and a+1 are loss-masked tokens of the same document (at inference the
anchor is always a generated token and at least one label follows it). A micro-batch has a fixed
number of anchor slots; anchors are drawn without replacement, one from each of `num_anchors`
equal strata of the valid positions (so the blocks tile the assistant text and every trainable
token is a label of some block when anchors are dense enough), and returned sorted. Unused slots
are padding (anchor 0, valid False).
"""
from __future__ import annotations

import numpy as np


def valid_anchor_positions(doc_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    ok = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    return np.nonzero(ok)[0].astype(np.int64)


def sample_anchors(
    doc_ids: np.ndarray, loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(anchors int64 [N], valid bool [N]); valid anchors first, sorted."""
    candidates = valid_anchor_positions(doc_ids, loss_mask)
    anchors = np.zeros(num_anchors, dtype=np.int64)
    valid = np.zeros(num_anchors, dtype=bool)
    n = len(candidates)
    if n <= num_anchors:
        chosen = candidates
    else:
        edges = np.linspace(0, n, num_anchors + 1).astype(np.int64)
        picks = edges[:-1] + (rng.random(num_anchors) * (edges[1:] - edges[:-1])).astype(np.int64)
        chosen = candidates[picks]
    anchors[: len(chosen)] = np.sort(chosen)
    valid[: len(chosen)] = True
    return anchors, valid
