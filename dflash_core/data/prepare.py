"""Tokenization once, in parallel, on disk: a job's datasets -> a memory-mapped corpus.

Every source file (sources.py) is tokenized into a cache entry under the data directory: the
token ids, the loss mask and the length and position (line or row) of every document, as flat
arrays that later jobs memory-map instead of reading into host memory. An entry's key is the
file's identity (path, size, modification time and a digest of its content), the tokenizer's
files, the chat template and its options, and the sequence length (documents are truncated to it
when tokenized); a changed file gets a new key, so an edited dataset is tokenized again (even one
edited in place with its size and mtime kept) and an unchanged one never is. Entries are written
durably with a manifest and verified whenever they are opened (cache_entry.py). An entry
holds no name of its file: errors are named by the source that opens it (two jobs can reach one
file through different names).

Work is split into chunks (byte ranges of a JSONL file, row ranges of parquet and `save_to_disk`
data, element batches of a JSON array) that worker processes read and tokenize themselves, so
the parent only stitches results together (the tasks live in chunks.py, what an entry is keyed by
in tokenization.py). Workers are spawned,
not forked (the daemon has threads, and a forked tokenizer can deadlock); each loads the engine's
tokenizer from a copy saved in the cache, which also keys the entries. Small datasets are tokenized in this process: starting
workers would cost more than it saves.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..confine import resolved_under
from .cache_entry import (
    BadEntry,
    process_limit,
    prune_quarantine,
    quarantine,
    sweep_partial,
    sync_dir,
    sync_files,
    temp_name,
    verified_meta,
    write_meta,
)
from .chunks import MAX_REPORTED_ERRORS, ChunkResult, PrepareCancelled, chunk_tasks, release_kept, tokenize_chunk
from .conversations import Conversation, DatasetError, parse_conversation
from .sources import SourceFile, dataset_files, file_size, iter_records, text_bytes, unreadable
from .tokenization import Tokenization
from .workers import result_or_stop, stop_workers, worker_pool

__all__ = ["PrepareCancelled", "PrepareProgress", "Tokenization", "prepare_corpus", "save_tokenizer"]
log = logging.getLogger("dflash.data")

IN_PROCESS_BYTES = 8 << 20  # below this much data, tokenize here


def save_tokenizer(tokenizer, cache_root: Path) -> tuple[Path, str]:
    """A copy of `tokenizer` (with any token the engine added) in the cache, and its content hash."""
    (cache_root / "tokenizers").mkdir(parents=True, exist_ok=True)
    sweep_partial(cache_root / "tokenizers")
    tmp = cache_root / "tokenizers" / temp_name("tokenizer")
    tmp.mkdir()
    tokenizer.save_pretrained(str(tmp))
    digest = hashlib.sha256()
    for p in sorted(tmp.iterdir()):
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h = digest.hexdigest()[:32]
    final = cache_root / "tokenizers" / h
    if final.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            os.rename(tmp, final)
        except OSError:  # another process saved the same tokenizer first
            shutil.rmtree(tmp, ignore_errors=True)
    return final, h


# --------------------------------------------------------------------------- one file's entry
@dataclass
class Shard:
    """One source file's documents, memory-mapped from its cache entry."""

    source: SourceFile
    directory: Path
    tokens: np.ndarray  # int32 [total tokens]
    mask: np.ndarray  # uint8 [total tokens]
    lengths: np.ndarray  # int64 [documents]
    starts: np.ndarray  # int64 [documents]: offset of each document in tokens
    positions: np.ndarray  # int64 [documents]: line or row of each document's record
    meta: dict

    @property
    def errors(self) -> list[DatasetError]:
        return [DatasetError(self.source.name, e["line"], e["reason"], e["unit"]) for e in self.meta["errors"]]


TRAINABLE_BLOCK_TOKENS = 1 << 22


def _trainable(shard: Shard) -> np.ndarray:
    """Corpus.trainable for one shard, a block of documents at a time."""
    n = len(shard.lengths)
    ok = np.zeros(n, dtype=bool)
    ends = shard.starts + shard.lengths
    a = 0
    while a < n:
        # the documents that end within the block from document a's start (at least a itself)
        b = max(a + 1, int(np.searchsorted(ends, shard.starts[a] + TRAINABLE_BLOCK_TOKENS, side="right")))
        lo, hi = int(shard.starts[a]), int(ends[b - 1])
        masked = np.concatenate(([0], np.cumsum(shard.mask[lo:hi], dtype=np.int64)))
        starts, lengths = shard.starts[a:b] - lo, shard.lengths[a:b]
        after_first = masked[starts + lengths] - masked[np.minimum(starts + 1, hi - lo)]
        ok[a:b] = (lengths >= 2) & (after_first > 0)
        a = b
    return ok


def _open_verified(src: SourceFile, directory: Path, in_memory: list[int]) -> Shard:
    """The entry's shard once it matches its manifest; raises BadEntry, or DatasetError where
    this process ran out of open files or memory maps (the entry is not at fault)."""
    try:
        meta = verified_meta(directory)
        return _open_shard(src, directory, meta, in_memory)
    except OSError as e:
        if process_limit(e):
            raise DatasetError(
                src.name,
                0,
                f"its tokenized cache entry cannot be opened: the daemon ran out of {e.strerror or e} "
                "(an open corpus maps two arrays per source file, past the small ones it reads into memory: "
                "raise the open-file limit, or merge small files)",
            ) from None
        raise BadEntry(f"its arrays cannot be mapped ({e})") from None
    except ValueError as e:
        raise BadEntry(f"its arrays cannot be mapped ({e})") from None


# arrays up to SMALL_ARRAY_BYTES are read into memory rather than mapped, up to
# IN_MEMORY_BYTES per corpus: a mapping holds an open file and a memory map for as long as the
# corpus is open, and a dataset of many small files would run out of both; past the budget they
# are mapped, so memory does not grow with the dataset
SMALL_ARRAY_BYTES = 1 << 20
IN_MEMORY_BYTES = 256 << 20


def _open_shard(src: SourceFile, directory: Path, meta: dict, in_memory: list[int]) -> Shard:
    """in_memory: [bytes the corpus may still read into memory], spent here."""

    def mapped(name: str, dtype) -> np.ndarray:
        path = directory / name
        size = path.stat().st_size
        if size == 0:
            return np.zeros(0, dtype=dtype)
        if size <= SMALL_ARRAY_BYTES and size <= in_memory[0]:
            in_memory[0] -= size
            return np.fromfile(path, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    lengths = np.fromfile(directory / "lengths.i64", dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        starts[1:] = np.cumsum(lengths)[:-1]
    return Shard(
        src,
        directory,
        mapped("tokens.i32", np.int32),
        mapped("mask.u8", np.uint8),
        lengths,
        starts,
        np.fromfile(directory / "positions.i64", dtype=np.int64),
        meta,
    )


# --------------------------------------------------------------------------- the corpus
@dataclass
class PrepareProgress:
    files_total: int
    files_done: int = 0
    files_cached: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rebuilt: list[dict] = field(default_factory=list)  # corrupt cache entries set aside: {dataset, entry, reason}

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


@dataclass
class Corpus:
    """The documents of a job's datasets: memory-mapped shards behind one document index."""

    shards: list[Shard]
    lengths: np.ndarray = field(init=False)  # int64 [documents]
    _shard_of: np.ndarray = field(init=False)
    _first: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        counts = [len(s.lengths) for s in self.shards]
        self.lengths = np.concatenate([s.lengths for s in self.shards]) if self.shards else np.zeros(0, np.int64)
        self._shard_of = np.repeat(np.arange(len(self.shards)), counts)
        self._first = np.concatenate(([0], np.cumsum(counts)))[:-1].astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, loss mask bool) of document i."""
        shard = self.shards[int(self._shard_of[i])]
        local = int(i - self._first[self._shard_of[i]])
        lo = int(shard.starts[local])
        hi = lo + int(shard.lengths[local])
        return shard.tokens[lo:hi].astype(np.int64), shard.mask[lo:hi].astype(bool)

    def trainable(self) -> np.ndarray:
        """bool [documents]: at least one loss-masked token after the first (a label exists).
        Computed once per job from the memory-mapped masks, shard by shard and, within a shard,
        over blocks of documents of about TRAINABLE_BLOCK_TOKENS tokens: a running count of
        the whole mask would take 8 bytes per token of the largest shard."""
        out = np.zeros(len(self), dtype=bool)
        for k, shard in enumerate(self.shards):
            out[self._first[k] : self._first[k] + len(shard.lengths)] = _trainable(shard)
        return out

    def conversations(self, indices: list[int]) -> list[Conversation]:
        """The conversations of documents `indices`, read again from their sources (evaluation
        prompts), in the order given; one pass over each file involved."""
        wanted: dict[int, dict[int, int]] = {}  # shard -> position -> document
        for i in indices:
            k = int(self._shard_of[i])
            wanted.setdefault(k, {})[int(self.shards[k].positions[i - self._first[k]])] = i
        found: dict[int, Conversation] = {}
        for k, positions in wanted.items():
            src = self.shards[k].source
            for pos, record in iter_records(src):
                if pos in positions and not isinstance(record, DatasetError):
                    found[positions[pos]] = parse_conversation(record, src.name, pos, src.unit)
                    if len(found) == len(indices):
                        break
        missing = [i for i in indices if i not in found]
        if missing:
            src = self.shards[int(self._shard_of[missing[0]])].source
            raise DatasetError(src.name, 0, "a held-out record is gone: the file changed after it was tokenized")
        return [found[i] for i in indices]

    @property
    def truncated_documents(self) -> int:
        return sum(int(s.meta["truncated"]) for s in self.shards)

    @property
    def bad_records(self) -> int:
        return sum(int(s.meta["bad_records"]) for s in self.shards)

    def errors(self) -> list[DatasetError]:
        return [e for s in self.shards for e in s.errors]


def prepare_corpus(
    entries: list[str],
    tok: Tokenization,
    cache_root: Path,
    *,
    workers: int | None = None,
    progress: Callable[[PrepareProgress], None] = lambda p: None,
    should_stop: Callable[[], bool] = lambda: False,
    roots: list[str] | None = None,
    names: Mapping[str, str] | None = None,
) -> Corpus:
    """Tokenize what the cache lacks and open every shard. Raises DatasetError for an unusable
    entry (a missing file, an empty directory, a parquet file without a conversation column);
    bad records are kept in the entries' error lists for the caller to refuse or skip.
    names: how errors name each entry (keyed by the entry as passed; default: the entry itself),
    e.g. as the user gave it; a file found in a directory is named by its entry and its own name,
    never by what it resolves to."""
    listed: list[SourceFile] = []
    for entry in entries:
        name = (names or {}).get(str(entry), str(entry))
        real = resolved_under(entry, roots or [], "dataset", name)
        for src in dataset_files(real, name):
            listed.append(replace(src, path=resolved_under(src.path, roots or [], "a dataset file", src.name)))
    # a file reached twice (a directory and a file in it) is read once, under its first name
    first: dict[Path, SourceFile] = {}
    for src in listed:
        first.setdefault(src.path, src)
    sources = list(first.values())
    if len(sources) < len(listed):
        log.info("dataset files listed more than once are read once", extra={"fields": {"files": len(listed)}})
    sizes = [_reading(src, file_size) for src in sources]
    state = PrepareProgress(files_total=len(sources), bytes_total=sum(sizes))
    t0 = time.monotonic()
    todo: list[tuple[int, SourceFile, Path]] = []
    in_memory = [IN_MEMORY_BYTES]  # what the corpus's small arrays may take
    shards: dict[int, Shard] = {}
    cache_root.mkdir(parents=True, exist_ok=True)
    sweep_partial(cache_root)
    prune_quarantine(cache_root)  # copies set aside long ago go, even when nothing is quarantined again
    for i, src in enumerate(sources):
        directory = cache_root / _reading(src, tok.key)
        if os.path.lexists(directory):
            try:
                shards[i] = _open_verified(src, directory, in_memory)
            except BadEntry as e:
                quarantine(directory, str(e), src.name)
                state.rebuilt.append({"dataset": src.name, "entry": directory.name, "reason": str(e)})
        if i in shards:
            state.files_done += 1
            state.files_cached += 1
            state.bytes_done += sizes[i]
            state.documents += len(shards[i].lengths)
            state.tokens += int(shards[i].lengths.sum())
        else:
            todo.append((i, src, directory))
    progress(state)
    # what the files hold once decompressed decides whether workers are worth starting
    missing = sum(_reading(src, text_bytes) for _, src, _ in todo)
    workers = workers if workers is not None else (os.cpu_count() or 1)
    pool = None
    if todo and workers > 1 and missing > IN_PROCESS_BYTES:
        pool = worker_pool(workers)
    try:
        for i, src, directory in todo:
            _write_entry(src, directory, tok, pool, workers, state, progress, should_stop, t0)
            try:
                shards[i] = _open_verified(src, directory, in_memory)
            except BadEntry as e:  # written and synced a moment ago: the cache's storage is failing
                raise DatasetError(
                    src.name,
                    0,
                    f"its tokenized cache entry {directory.name} is corrupt right after it was written: {e}",
                ) from None
            state.files_done += 1
            progress(state)
    except BaseException:
        if pool is not None:  # a cancel or a failure: the workers' chunks in flight are not waited for
            stop_workers(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    state.seconds = time.monotonic() - t0
    progress(state)
    return Corpus([shards[i] for i in range(len(sources))])


_T = TypeVar("_T")


def _reading(src: SourceFile, read: Callable[[SourceFile], _T]) -> _T:
    """read(src), the system's refusal to read the file named as the user named it."""
    try:
        return read(src)
    except OSError as e:
        raise unreadable(src.name, e) from None


def _write_entry(
    src: SourceFile,
    directory: Path,
    tok: Tokenization,
    pool,
    workers: int,
    state: PrepareProgress,
    progress: Callable[[PrepareProgress], None],
    should_stop: Callable[[], bool],
    t0: float,
) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / temp_name(directory.name)
    tmp.mkdir()
    meta: dict[str, Any] = {
        "source": str(src.path),
        "kind": src.kind,
        "documents": 0,
        "tokens": 0,
        "records": 0,
        "bad_records": 0,
        "truncated": 0,
        "errors": [],
    }
    try:
        with (
            (tmp / "tokens.i32").open("wb") as f_tok,
            (tmp / "mask.u8").open("wb") as f_mask,
            (tmp / "lengths.i64").open("wb") as f_len,
            (tmp / "positions.i64").open("wb") as f_pos,
        ):
            for res in _results(src, tok, pool, workers, should_stop):
                if should_stop():
                    raise PrepareCancelled
                res.tokens.tofile(f_tok)
                res.mask.tofile(f_mask)
                res.lengths.tofile(f_len)
                res.positions.tofile(f_pos)
                meta["documents"] += len(res.lengths)
                meta["tokens"] += int(res.lengths.sum())
                meta["records"] += res.records
                meta["bad_records"] += res.bad_records
                meta["truncated"] += res.truncated
                room = MAX_REPORTED_ERRORS - len(meta["errors"])
                meta["errors"] += res.errors[: max(0, room)]
                state.bytes_done += res.size
                state.documents += len(res.lengths)
                state.tokens += int(res.lengths.sum())
                state.seconds = time.monotonic() - t0
                progress(state)
            sync_files(f_tok, f_mask, f_len, f_pos)
        write_meta(tmp, meta)
        try:
            os.rename(tmp, directory)
        except OSError:  # the same entry was written meanwhile: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
        sync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _results(
    src: SourceFile, tok: Tokenization, pool, workers: int, should_stop: Callable[[], bool] = lambda: False
) -> Iterator[ChunkResult]:
    """Chunk results in file order; at most 2 * workers chunks in flight. Only reading happens
    here (the caller writes), so an OSError is the source's. A stop is noticed while a chunk is
    being tokenized, not only between chunks (PrepareCancelled)."""
    try:
        if pool is None:
            try:
                for task, size in chunk_tasks(src):
                    yield tokenize_chunk(src, task, tok, size, should_stop)
            finally:
                release_kept()
            return
        pending: list[cf.Future[ChunkResult]] = []
        for task, size in chunk_tasks(src):
            pending.append(pool.submit(tokenize_chunk, src, task, tok, size))
            if len(pending) >= 2 * workers:
                yield result_or_stop(pending.pop(0), should_stop, PrepareCancelled)
        for fut in pending:
            yield result_or_stop(fut, should_stop, PrepareCancelled)
    except OSError as e:
        raise unreadable(src.name, e) from None
