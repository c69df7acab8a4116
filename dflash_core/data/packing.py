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


def pack_documents(
    docs: list[Document], seq_len: int, pad_token_id: int, report: PackingReport | None = None
) -> list[PackedSequence]:
    """Greedy in-order packing; a document longer than seq_len is truncated to seq_len."""
    report = report if report is not None else PackingReport()
    out: list[PackedSequence] = []
    current: list[Document] = []
    used = 0

    def flush() -> None:
        nonlocal current, used
        if not current:
            return
        ids = np.full(seq_len, pad_token_id, dtype=np.int64)
        doc = np.full(seq_len, PAD_DOC, dtype=np.int64)
        pos = np.zeros(seq_len, dtype=np.int64)
        mask = np.zeros(seq_len, dtype=bool)
        at = 0
        for i, d in enumerate(current):
            n = len(d.input_ids)
            ids[at : at + n] = d.input_ids
            doc[at : at + n] = i
            pos[at : at + n] = np.arange(n)
            mask[at : at + n] = d.loss_mask
            at += n
        out.append(PackedSequence(ids, doc, pos, mask))
        report.sequences += 1
        report.tokens += at
        report.padding_tokens += seq_len - at
        current, used = [], 0

    for d in docs:
        report.documents += 1
        if len(d.input_ids) > seq_len:
            report.truncated_documents += 1
            report.truncated_tokens += len(d.input_ids) - seq_len
            d = Document(d.input_ids[:seq_len], d.loss_mask[:seq_len], d.source)
        if d.loss_mask[1:].sum() == 0 or len(d.input_ids) < 2:
            report.dropped_documents += 1
            continue
        if used + len(d.input_ids) > seq_len:
            flush()
        current.append(d)
        used += len(d.input_ids)
    flush()
    return out
