"""The tasks of tokenization: a source file cut into chunks (byte ranges of a JSONL file, row
ranges of parquet and `save_to_disk` data, element batches of a JSON array), and one chunk read
and tokenized. Run in spawned worker processes (each loads the engine's tokenizer from the copy
saved in the cache, once per process) or, for small datasets, in the preparing process itself;
prepare.py stitches the results into cache entries.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..confine import open_regular
from .bounded import bounded_lines, count_newlines, next_line_start
from .conversations import DatasetError, parse_conversation
from .sources import (
    MAX_RECORD_BYTES,
    GroupRows,
    SourceFile,
    conversation_column,
    file_size,
    identity,
    iter_records,
    jsonl_lines,
    load_arrow_dataset,
)
from .tokenization import Tokenization
from .tokenize import encode_conversation

CHUNK_BYTES = 4 << 20  # JSONL bytes per task
CHUNK_ROWS = 4096  # parquet / save_to_disk rows per task
ARRAY_BATCH = 1024  # JSON array (and gzip JSONL) records per task, at most CHUNK_BYTES of text
MAX_REPORTED_ERRORS = 10
STOP_CHECK_RECORDS = 32  # records tokenized here between two looks at should_stop


class PrepareCancelled(Exception):
    """The job was cancelled while its data was being prepared."""


@dataclass
class ChunkResult:
    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    positions: np.ndarray
    errors: list[dict]
    bad_records: int
    truncated: int
    records: int
    size: int  # bytes of the source this chunk covered (progress)


_STATE: dict = {}


def _tokenizer(tokenizer_dir: str):
    if _STATE.get("dir") != tokenizer_dir:
        from transformers import AutoTokenizer

        _STATE["tokenizer"] = AutoTokenizer.from_pretrained(tokenizer_dir)
        _STATE["dir"] = tokenizer_dir
    return _STATE["tokenizer"]


def _chunk_records(src: SourceFile, task: tuple) -> Iterator[tuple[int, object]]:
    kind = task[0]
    if kind == "bytes":  # JSONL lines in [start, end), the first of them line `first_line`
        _, start, end, first_line = task
        with open_regular(src.path, src.name) as f:
            f.seek(start)
            # split on newlines only, as the JSONL reader and the line count of chunk_tasks do (splitlines
            # would also split on a bare carriage return and shift every later line number)
            yield from jsonl_lines(src.name, bounded_lines(f, MAX_RECORD_BYTES, end), first_line)
    elif kind == "rows":
        _, start, stop = task
        yield from _rows(src, start, stop)
    else:  # "records": already read (JSON arrays)
        yield from task[1]


def _rows(src: SourceFile, start: int, stop: int) -> Iterator[tuple[int, object]]:
    if src.kind == "parquet":
        yield from _parquet_rows(src, start, stop)
        return
    column = _column(src)
    table = _arrow_table(src, column).slice(start, stop - start)
    for i, value in enumerate(table.column(0).to_pylist()):
        yield start + i + 1, {column: value}


def _arrow_table(src: SourceFile, column: str):
    """A save_to_disk directory's conversation column as a memory-mapped Arrow table, loaded once
    per process for the directory as it is now (its files' sizes and times): its tasks slice it
    instead of loading the dataset again, which costs more the more arrow files it has."""

    def load():
        return load_arrow_dataset(src.path, src.name).select_columns([column]).with_format("arrow")[:]

    return _kept("arrow", (str(src.path), tuple(identity(src))), load)


def _parquet_rows(src: SourceFile, start: int, stop: int) -> Iterator[tuple[int, object]]:
    """Rows [start, stop) of a parquet file, read from the row groups they lie in only (a task
    reading the whole column would make a file's reading grow with the square of its rows). A
    group within the range is read whole; one the range cuts is read forward in batches from a
    stream the process keeps for the group's next rows, so a file written as one huge group costs
    each worker a batch of it, not the whole decoded group. A group that cannot be read is one
    DatasetError per task, at the row it broke at or the task's first row after it."""
    import pyarrow.parquet as pq

    column = _column(src)
    metadata, firsts = _parquet_layout(src)
    with contextlib.ExitStack() as stack:
        whole = None  # the file, opened for the groups read whole
        # the first group holding row `start`: a file of many small groups is not walked from its start
        for group in range(max(0, bisect.bisect_right(firsts, start) - 1), len(firsts) - 1):
            offset, count = firsts[group], firsts[group + 1] - firsts[group]
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi and (lo, hi) == (offset, offset + count):
                if whole is None:
                    whole = pq.ParquetFile(stack.enter_context(open_regular(src.path, src.name)), metadata=metadata)
                yield from _whole_group(src, metadata, whole, group, column, offset, count)
            elif lo < hi:
                yield from _cut_group(src, metadata, group, column, offset, count, lo, hi)
            if offset + count >= stop:
                return


def _whole_group(src: SourceFile, metadata, pf, group: int, column: str, offset: int, count: int):
    try:
        values = pf.read_row_group(group, columns=[column]).column(0).to_pylist()
    except (OSError, ValueError):  # a damaged page (or one not UTF-8): the rows before it, as one pass reads them
        stream = _GroupStream(src, metadata, group, column, offset, count)
        try:
            yield from stream.rows(offset + 1, offset + count + 1)
        finally:
            stream.close()
    else:
        for i, value in enumerate(values):
            yield offset + i + 1, {column: value}


def _cut_group(src: SourceFile, metadata, group: int, column: str, offset: int, count: int, lo: int, hi: int):
    """Rows [lo, hi) of a group the task's range cuts, from the stream the process keeps for it."""
    key = (*_file_key(src), group)
    fresh = functools.partial(_GroupStream, src, metadata, group, column, offset, count)
    stream = _kept("group", key, fresh, keep=False)
    if stream.next_row > lo + 1:  # past this task's rows (a task read again): from the group's start
        stream.close()
        stream = fresh()
    try:
        yield from stream.rows(lo + 1, hi + 1)
    except BaseException:
        stream.close()
        raise
    if hi < offset + count:  # a later task reads more of the group
        _STATE["group"] = (key, stream)
    else:
        stream.close()


class _GroupStream(GroupRows):
    """A row group's rows with its own open file: what a process keeps between its tasks in a
    group larger than a task."""

    def __init__(self, src: SourceFile, metadata: Any, group: int, column: str, offset: int, count: int):
        import pyarrow.parquet as pq

        self.file = open_regular(src.path, src.name)
        try:
            pf = pq.ParquetFile(self.file, metadata=metadata, buffer_size=1 << 20, pre_buffer=False)
            super().__init__(src, pf, group, column, offset + 1, count)
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.file.close()


def release_kept() -> None:
    """Close what this process keeps open between tasks (a row group's stream): for the preparing
    process itself, when it stops reading a file's tasks before their end."""
    cached = _STATE.pop("group", None)
    if cached is not None:
        cached[1].close()


def _parquet_layout(src: SourceFile) -> tuple[Any, list[int]]:
    """The file's footer and each row group's first row (and the row count last): its tasks do not
    parse the footer again, which grows with the groups."""
    import pyarrow.parquet as pq

    def load() -> tuple[Any, list[int]]:
        with open_regular(src.path, src.name) as f:
            metadata = pq.ParquetFile(f).metadata
        firsts = [0]
        for group in range(metadata.num_row_groups):
            firsts.append(firsts[-1] + metadata.row_group(group).num_rows)
        return metadata, firsts

    return _kept("layout", _file_key(src), load)


def _file_key(src: SourceFile) -> tuple[str, int, int]:
    st = src.path.stat()
    return str(src.path), st.st_size, st.st_mtime_ns


def _kept(slot: str, key: tuple, make: Callable[[], Any], keep: bool = True) -> Any:
    """make(), or what this process kept in `slot` for the same key: what a file's tasks share
    (its footer, a row group larger than a task, a dataset's table), one per slot, keyed by the
    file as it is now so that one rewritten since is read anew. keep=False: the last use, the
    slot is emptied."""
    cached = _STATE.pop(slot, None)
    if cached is not None and cached[0] != key and hasattr(cached[1], "close"):
        cached[1].close()  # another file's or group's stream
    value = cached[1] if cached is not None and cached[0] == key else make()
    if keep:
        _STATE[slot] = (key, value)
    return value


def _column(src: SourceFile) -> str:
    """The conversation column of a parquet or save_to_disk source, looked up once per process."""
    key = ("column", str(src.path))
    if key not in _STATE:
        _STATE[key] = conversation_column(src)
    return _STATE[key]


def tokenize_chunk(
    src: SourceFile, task: tuple, tok: Tokenization, size: int, should_stop: Callable[[], bool] | None = None
) -> ChunkResult:
    """Read one chunk's records and tokenize them (in a worker process, or here: then
    should_stop is asked every STOP_CHECK_RECORDS records)."""
    kept = _STATE.get("group")
    if kept is not None and kept[0][0] != str(src.path):  # another file's: no later task of this worker reads it
        release_kept()
    tokenizer = _tokenizer(tok.tokenizer_dir)
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lengths: list[int] = []
    positions: list[int] = []
    errors: list[dict] = []
    bad = truncated = records = 0
    for position, record in _chunk_records(src, task):
        records += 1
        if should_stop is not None and records % STOP_CHECK_RECORDS == 0 and should_stop():
            raise PrepareCancelled
        try:
            if isinstance(record, DatasetError):
                raise record
            conv = parse_conversation(record, src.name, position, src.unit)
            doc = encode_conversation(tokenizer, conv, tok.template, max_tokens=tok.seq_len)
        except DatasetError as err:
            bad += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append({"path": err.path, "line": err.line, "reason": err.reason, "unit": err.unit})
            continue
        ids, mask = doc.input_ids, doc.loss_mask
        truncated += doc.cut
        ids_parts.append(ids.astype(np.int32))
        mask_parts.append(mask.astype(np.uint8))
        lengths.append(len(ids))
        positions.append(position)
    cat = np.concatenate
    return ChunkResult(
        cat(ids_parts) if ids_parts else np.zeros(0, np.int32),
        cat(mask_parts) if mask_parts else np.zeros(0, np.uint8),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(positions, dtype=np.int64),
        errors,
        bad,
        truncated,
        records,
        size,
    )


def chunk_tasks(src: SourceFile) -> Iterator[tuple[tuple, int]]:
    """(task, bytes of progress it stands for) covering the whole file, in order."""
    if src.kind == "jsonl":
        size = src.path.stat().st_size
        with open_regular(src.path, src.name) as f:
            start, line = 0, 1
            while start < size:
                # to the end of the line the boundary falls in (scanned, never read whole)
                end = next_line_start(f, start + CHUNK_BYTES, size) if start + CHUNK_BYTES < size else size
                lines = count_newlines(f, start, end)
                yield ("bytes", start, end, line), end - start
                start, line = end, line + lines
    elif src.kind in ("parquet", "arrow"):
        total = _row_count(src)
        size = max(1, file_size(src))
        for start in range(0, total, CHUNK_ROWS):
            stop = min(total, start + CHUNK_ROWS)
            yield ("rows", start, stop), size * (stop - start) // max(1, total)
    else:
        # parsed here and sent to a worker: a task's records are bounded by their text as well as
        # their count, so large elements do not put gigabytes in flight
        size = max(1, src.path.stat().st_size)
        batch: list[tuple[int, object]] = []
        text = 0
        for position, record in iter_records(src):
            record = _conversation_only(record)
            batch.append((position, record))
            text += _text_chars(record)
            if len(batch) >= ARRAY_BATCH or text >= CHUNK_BYTES:
                yield ("records", batch), 0
                batch, text = [], 0
        yield ("records", batch), size


def _conversation_only(record: object) -> object:
    """A record as a worker needs it: its conversation fields, not what else it carries (an image
    or a log beside the messages would be sent to the worker for nothing). The reader has checked
    the whole record's nesting already."""
    if isinstance(record, dict) and ("messages" in record or "conversations" in record):
        return {k: record[k] for k in ("messages", "conversations") if k in record}
    return record


def _text_chars(record: object) -> int:
    """The characters of a record's messages (what its size is made of), counted without
    serializing it; anything else in it counts for nothing."""
    if not isinstance(record, dict):
        return 0
    messages = record.get("messages", record.get("conversations"))
    if not isinstance(messages, list):
        return 0
    return sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))


def _row_count(src: SourceFile) -> int:
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        with open_regular(src.path, src.name) as f:
            return int(pq.ParquetFile(f).metadata.num_rows)
    return len(load_arrow_dataset(src.path, src.name))
