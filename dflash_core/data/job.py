"""A job's datasets -> tokenized documents (train and held-out), with readable failures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .conversations import Conversation, DatasetError, ReadReport, read_conversations
from .tokenize import Document, encode_conversation


@dataclass
class JobData:
    train: list[Document]
    heldout: list[Conversation]
    skipped_lines: int = 0
    skip_messages: list[str] = field(default_factory=list)


def load_job_data(
    paths: list[str], tokenizer, *, skip_bad_lines: bool, eval_prompts: str | None, eval_fraction: float, seed: int
) -> JobData:
    report = ReadReport()
    convs: list[Conversation] = []
    for path in paths:
        convs.extend(read_conversations(path, skip_bad_lines=skip_bad_lines, report=report))
    if not convs:
        raise DatasetError(paths[0] if paths else "?", 0, "no usable conversation in the datasets")
    heldout: list[Conversation] = []
    if eval_prompts:
        heldout = list(read_conversations(eval_prompts, skip_bad_lines=skip_bad_lines, report=report))
    elif eval_fraction > 0:
        order = np.random.default_rng([seed, 7]).permutation(len(convs))
        n = max(1, int(len(convs) * eval_fraction))
        held = set(order[:n].tolist())
        heldout = [c for i, c in enumerate(convs) if i in held]
        convs = [c for i, c in enumerate(convs) if i not in held]
    docs = []
    for c in convs:
        try:
            docs.append(encode_conversation(tokenizer, c))
        except DatasetError as err:
            if not skip_bad_lines:
                raise
            report.note_skip(err)
    return JobData(docs, heldout, report.skipped, report.first_errors)
