"""Fixed-shape packing: documents -> sequences of exactly `seq_len` tokens.

Each packed sequence carries document ids (-1 on padding) and position ids that restart at
every document, so the target and the drafter never attend across documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tokenize import Document

PAD_DOC = -1


@dataclass
class PackedSequence:
    input_ids: np.ndarray  # int64 [S]
    doc_ids: np.ndarray  # int64 [S], PAD_DOC on padding
    position_ids: np.ndarray  # int64 [S]
    loss_mask: np.ndarray  # bool [S]


@dataclass
class PackingReport:
    documents: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0
    dropped_documents: int = 0  # nothing left to train on after truncation
    sequences: int = 0
    tokens: int = 0
    padding_tokens: int = 0


@dataclass
class PackingPlan:
    """Which documents fill which packed sequence, without their tokens: sequence k holds
    documents members[offsets[k]:offsets[k + 1]] in that order (each truncated to seq_len)."""

    offsets: np.ndarray  # int64 [sequences + 1]
    members: np.ndarray  # int64 [packed documents]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, k: int) -> np.ndarray:
        return self.members[self.offsets[k] : self.offsets[k + 1]]


def plan_packing(
    order: np.ndarray, lengths: np.ndarray, trainable: np.ndarray, seq_len: int, report: PackingReport | None = None
) -> PackingPlan:
    """Greedy in-order packing of documents `order` (indices into lengths / trainable): a
    document longer than seq_len is truncated to it; one with no label after truncation is
    dropped. `trainable` must already reflect the truncation."""
    report = report if report is not None else PackingReport()
    offsets = [0]
    members: list[int] = []
    used = 0
    for d in order:
        d = int(d)
        n = int(lengths[d])
        report.documents += 1
        if n > seq_len:
            report.truncated_documents += 1
            report.truncated_tokens += n - seq_len
            n = seq_len
        if not trainable[d] or n < 2:
            report.dropped_documents += 1
            continue
        if used + n > seq_len:
            offsets.append(len(members))
            report.sequences += 1
            report.tokens += used
            report.padding_tokens += seq_len - used
            used = 0
        members.append(d)
        used += n
    if used:
        offsets.append(len(members))
        report.sequences += 1
        report.tokens += used
        report.padding_tokens += seq_len - used
    return PackingPlan(np.asarray(offsets, dtype=np.int64), np.asarray(members, dtype=np.int64))


def build_sequence(docs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_token_id: int) -> PackedSequence:
    """One packed sequence from (token ids, loss mask) pairs, each cut to what fits."""
    ids = np.full(seq_len, pad_token_id, dtype=np.int64)
    doc = np.full(seq_len, PAD_DOC, dtype=np.int64)
    pos = np.zeros(seq_len, dtype=np.int64)
    mask = np.zeros(seq_len, dtype=bool)
    at = 0
    for i, (d_ids, d_mask) in enumerate(docs):
        n = min(len(d_ids), seq_len - at)
        ids[at : at + n] = d_ids[:n]
        doc[at : at + n] = i
        pos[at : at + n] = np.arange(n)
        mask[at : at + n] = d_mask[:n]
        at += n
    return PackedSequence(ids, doc, pos, mask)


def trainable_after_truncation(mask: np.ndarray, seq_len: int) -> bool:
    m = mask[:seq_len]
    return len(m) >= 2 and bool(m[1:].any())


def pack_documents(
    docs: list[Document], seq_len: int, pad_token_id: int, report: PackingReport | None = None
) -> list[PackedSequence]:
    """Greedy in-order packing; a document longer than seq_len is truncated to seq_len."""
    lengths = np.asarray([len(d.input_ids) for d in docs], dtype=np.int64)
    trainable = np.asarray([trainable_after_truncation(d.loss_mask, seq_len) for d in docs], dtype=bool)
    plan = plan_packing(np.arange(len(docs)), lengths, trainable, seq_len, report)
    return [
        build_sequence([(docs[d].input_ids, docs[d].loss_mask) for d in plan.sequence(k)], seq_len, pad_token_id)
        for k in range(len(plan))
    ]
