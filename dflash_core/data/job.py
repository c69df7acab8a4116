"""A job's datasets -> a tokenized corpus (cached on disk) and held-out prompts, with readable
failures."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..confine import resolved_under
from .conversations import Conversation, DatasetError, ReadReport, read_conversations
from .prepare import Corpus, PrepareProgress, Tokenization, prepare_corpus


@dataclass
class JobData:
    corpus: Corpus
    heldout: list[Conversation]  # evaluation prompts (at most the job's eval_max_prompts)
    exclude: np.ndarray  # documents held out of training (eval_fraction)
    skipped_lines: int = 0
    skip_messages: list[str] = field(default_factory=list)
    progress: PrepareProgress | None = None


def load_job_data(
    paths: list[str],
    tokenization: Tokenization,
    cache_root: Path,
    *,
    skip_bad_lines: bool,
    eval_prompts: str | None,
    eval_fraction: float,
    eval_max_prompts: int,
    seed: int,
    progress: Callable[[PrepareProgress], None] = lambda p: None,
    should_stop: Callable[[], bool] = lambda: False,
    roots: list[str] | None = None,
    names: Mapping[str, str] | None = None,
) -> JobData:
    """roots: where the datasets must still resolve to when they are read (empty: anywhere).
    names: how errors name each dataset entry and eval_prompts (keyed by the path as passed;
    default: the path itself), e.g. as the user gave it."""
    last: list[PrepareProgress] = []

    def seen(p: PrepareProgress) -> None:
        last[:] = [p]
        progress(p)

    corpus = prepare_corpus(
        paths, tokenization, cache_root, progress=seen, should_stop=should_stop, roots=roots, names=names
    )
    errors = corpus.errors()
    if errors and not skip_bad_lines:
        first = errors[0]
        raise DatasetError(
            first.path, first.line, f"{first.reason} (set skip_bad_lines to skip such records)", first.unit
        )
    if not len(corpus):
        first_entry = str(paths[0]) if paths else "?"
        raise DatasetError((names or {}).get(first_entry, first_entry), 0, "no usable conversation in the datasets")
    report = ReadReport(skipped=corpus.bad_records, first_errors=[str(e) for e in errors])
    heldout: list[Conversation] = []
    exclude = np.zeros(0, dtype=np.int64)
    if eval_prompts:
        name = (names or {}).get(eval_prompts, eval_prompts)
        prompts = resolved_under(eval_prompts, roots or [], "eval_prompts", name)
        for conv in read_conversations(prompts, skip_bad_lines=skip_bad_lines, report=report, name=name):
            heldout.append(conv)
            if len(heldout) >= eval_max_prompts:
                break
    elif eval_fraction > 0:
        order = np.random.default_rng([seed, 7]).permutation(len(corpus))
        exclude = np.sort(order[: max(1, int(len(corpus) * eval_fraction))])
        heldout = corpus.conversations(exclude[:eval_max_prompts].tolist())
    return JobData(corpus, heldout, exclude, report.skipped, report.first_errors, last[0] if last else None)
