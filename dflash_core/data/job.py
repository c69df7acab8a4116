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


@dataclass(frozen=True)
class Datasets:
    """A job's datasets as read: the paths, whether bad records are skipped, where they must
    still resolve to when read (empty: anywhere) and how errors name each entry and the eval
    prompts (keyed by the path as passed; default: the path itself, e.g. as the user gave it)."""

    paths: list[str]
    skip_bad_lines: bool = False
    roots: list[str] | None = None
    names: Mapping[str, str] | None = None

    def name(self, path: str) -> str:
        return (self.names or {}).get(path, path)


@dataclass(frozen=True)
class EvalSplit:
    """Where a job's held-out prompts come from: a file of its own (`prompts`), else a fraction
    of the corpus (held out of training, drawn with `seed`); at most `max_prompts`."""

    prompts: str | None
    fraction: float
    max_prompts: int
    seed: int


@dataclass
class JobData:
    corpus: Corpus
    heldout: list[Conversation]  # evaluation prompts (at most the job's eval_max_prompts)
    exclude: np.ndarray  # documents held out of training (eval_fraction)
    skipped_lines: int = 0
    skip_messages: list[str] = field(default_factory=list)
    progress: PrepareProgress | None = None


def load_job_data(
    datasets: Datasets,
    tokenization: Tokenization,
    cache_root: Path,
    split: EvalSplit,
    *,
    progress: Callable[[PrepareProgress], None] = lambda p: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> JobData:
    """The tokenized corpus of `datasets` (what the cache under cache_root lacks is tokenized
    now, reported to `progress`) and the held-out prompts of `split`."""
    paths, skip_bad_lines, roots, names = datasets.paths, datasets.skip_bad_lines, datasets.roots, datasets.names
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
        raise DatasetError(datasets.name(first_entry), 0, "no usable conversation in the datasets")
    report = ReadReport(skipped=corpus.bad_records, first_errors=[str(e) for e in errors])
    heldout: list[Conversation] = []
    exclude = np.zeros(0, dtype=np.int64)
    if split.prompts:
        name = datasets.name(split.prompts)
        prompts = resolved_under(split.prompts, roots or [], "eval_prompts", name)
        for conv in read_conversations(prompts, skip_bad_lines=skip_bad_lines, report=report, name=name):
            heldout.append(conv)
            if len(heldout) >= split.max_prompts:
                break
    elif split.fraction > 0:
        order = np.random.default_rng([split.seed, 7]).permutation(len(corpus))
        exclude = np.sort(order[: max(1, int(len(corpus) * split.fraction))])
        heldout = corpus.conversations(exclude[: split.max_prompts].tolist())
    return JobData(corpus, heldout, exclude, report.skipped, report.first_errors, last[0] if last else None)
