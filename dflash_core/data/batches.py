"""Micro-batches of identical shapes, in a deterministic, resumable order.

Micro-batch g (global index over the whole run) depends only on (seed, g): epoch e shuffles
the documents with seed (seed, e) and packs them; anchors of micro-batch g are drawn with seed
(seed, g). Resuming at g therefore needs no RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..config import ShapeConfig
from .anchors import sample_anchors
from .packing import PackedSequence, PackingReport, build_sequence, pack_documents, plan_packing
from .tokenize import Document


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [S]
    position_ids: torch.Tensor  # int64 [S]
    doc_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    anchors: torch.Tensor  # int64 [N]
    anchor_valid: torch.Tensor  # bool [N]
    index: int = 0  # global micro-batch index

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        kw: dict[str, Any] = dict(device=device, non_blocking=non_blocking)
        return MicroBatch(
            self.input_ids.to(**kw),
            self.position_ids.to(**kw),
            self.doc_ids.to(**kw),
            self.loss_mask.to(**kw),
            self.anchors.to(**kw),
            self.anchor_valid.to(**kw),
            self.index,
        )

    def pin_memory(self) -> MicroBatch:
        return MicroBatch(
            self.input_ids.pin_memory(),
            self.position_ids.pin_memory(),
            self.doc_ids.pin_memory(),
            self.loss_mask.pin_memory(),
            self.anchors.pin_memory(),
            self.anchor_valid.pin_memory(),
            self.index,
        )

    @property
    def context_tokens(self) -> int:
        """Non-padding context tokens (the unit of the tokens/s metrics)."""
        return int((self.doc_ids >= 0).sum())


def make_micro_batch(seq: PackedSequence, shape: ShapeConfig, rng: np.random.Generator, index: int) -> MicroBatch:
    # the training mask reads "same document" as "same contiguous run" (attention.context_intervals)
    runs = np.flatnonzero(np.diff(seq.doc_ids)) + 1
    run_ids = seq.doc_ids[np.concatenate(([0], runs))]
    if len(np.unique(run_ids)) != len(run_ids):
        raise ValueError(
            "a packed sequence holds a document id in more than one run; packing must keep each document contiguous"
        )
    anchors, valid = sample_anchors(seq.doc_ids, seq.loss_mask, shape.num_anchors, rng, shape.block_size)
    return MicroBatch(
        torch.from_numpy(seq.input_ids),
        torch.from_numpy(seq.position_ids),
        torch.from_numpy(seq.doc_ids),
        torch.from_numpy(seq.loss_mask),
        torch.from_numpy(anchors),
        torch.from_numpy(valid),
        index,
    )


def synthetic_micro_batch(shape: ShapeConfig, vocab_size: int, pad_token_id: int, seed: int = 1234) -> MicroBatch:
    """A micro-batch at the given shape with realistic structure (several packed documents whose
    last three quarters are assistant text) and random tokens: for warmup and benchmarks."""
    rng = np.random.default_rng(seed)
    docs, used = [], 0
    while used < shape.seq_len:
        n = min(shape.seq_len - used, int(rng.integers(max(4, shape.seq_len // 8), max(8, shape.seq_len // 3))))
        if n < 2:
            break
        mask = np.zeros(n, dtype=bool)
        mask[n // 4 :] = True
        docs.append(Document(rng.integers(0, vocab_size, size=n).astype(np.int64), mask, "synthetic"))
        used += n
    return make_micro_batch(pack_documents(docs, shape.seq_len, pad_token_id)[0], shape, rng, 0)


class DocumentList:
    """A list of in-memory Documents with the interface of a Corpus (prepare.py)."""

    def __init__(self, docs: list[Document]):
        self.docs = docs
        self.lengths = np.asarray([len(d.input_ids) for d in docs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.docs)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.docs[i].input_ids, self.docs[i].loss_mask

    def trainable(self) -> np.ndarray:
        return np.asarray([len(d.loss_mask) >= 2 and bool(d.loss_mask[1:].any()) for d in self.docs], dtype=bool)


class BatchSource(Protocol):
    """What the feature pipeline reads micro-batches from: micro-batch g by its global index."""

    per_epoch: int

    def get(self, index: int) -> MicroBatch: ...


class MicroBatchStream:
    """Endless, deterministic sequence of micro-batches over the documents (epoch after epoch).

    Documents are packed once (in a seeded order) into a plan of document indices; each epoch
    visits the packed sequences in its own seeded order, so every epoch has the same number of
    micro-batches. Tokens are read only when a micro-batch is built: a memory-mapped corpus is
    never loaded whole.
    """

    def __init__(self, docs, shape: ShapeConfig, pad_token_id: int, seed: int, exclude: np.ndarray | None = None):
        """docs: a Corpus or a list of Documents; exclude: document indices not to train on."""
        self.docs = DocumentList(docs) if isinstance(docs, list) else docs
        if not len(self.docs):
            raise ValueError("no documents to train on")
        self.shape, self.seed, self.pad = shape, seed, pad_token_id
        self.report = PackingReport()
        trainable = self.docs.trainable()
        if exclude is not None and len(exclude):
            trainable = trainable.copy()
            trainable[exclude] = False
        order = np.random.default_rng([seed, 0]).permutation(len(self.docs))
        self.plan = plan_packing(order, self.docs.lengths, trainable, shape.seq_len, self.report)
        if not len(self.plan):
            # documents come here cut to seq_len (the corpus is prepared so): an assistant turn
            # past it is gone, which is what a long prompt does
            raise ValueError(
                f"no document has a trainable (assistant) token after packing: none of the {self.report.documents} "
                f"documents has an assistant token within its first {shape.seq_len} tokens (seq_len; longer "
                "documents are cut to it); a longer seq_len or shorter conversations would train"
            )
        self.per_epoch = len(self.plan)
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, 1, epoch]).permutation(self.per_epoch)}
        return self._orders[epoch]

    def sequence(self, k: int) -> PackedSequence:
        docs = [self.docs.document(int(d)) for d in self.plan.sequence(k)]
        return build_sequence(docs, self.shape.seq_len, self.pad)

    def get(self, index: int) -> MicroBatch:
        epoch, i = divmod(index, self.per_epoch)
        seq = self.sequence(int(self._order(epoch)[i]))
        return make_micro_batch(seq, self.shape, np.random.default_rng([self.seed, 2, index]), index)
