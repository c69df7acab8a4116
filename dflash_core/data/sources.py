"""Where conversations come from: the dataset layouts users keep, read record by record.

A dataset entry is one of
  * a JSONL file (`.jsonl`, or a `.json` file whose first character is not `[`), or one
    gzip-compressed (`.jsonl.gz`, read as it is decompressed: never whole in memory),
  * a JSON array file (`.json` starting with `[`),
  * a parquet file (`.parquet`),
  * a directory written by `datasets.Dataset.save_to_disk` (or a `DatasetDict`, whose `train`
    split is used),
  * a directory of shards: its `*.jsonl`, `*.jsonl.gz`, `*.json` and `*.parquet` files, in sorted order,
  * a regeneration job's output directory: the complete shards its manifest lists (regenerated.py).
Every record is a conversation in OpenAI `messages` or ShareGPT `conversations` form
(conversations.py). Parquet and `save_to_disk` data are read with pyarrow and HF `datasets`;
JSON text is read here, line by line or element by element, because a broken record must be
reported by file and line, and a JSON reader that parses a whole file at once cannot say where.

Records come out as (position, record) pairs, the position being the line (JSONL), the element's
ordinal (JSON arrays; a syntax error is reported by line) or the row (parquet, `save_to_disk`); a
record that cannot be read comes out as a DatasetError in its place, so that the caller decides
whether to skip it.

Messages name a file as the user named it: the dataset entry as given, plus the file's path
relative to it for a file found by listing a directory. What a path resolves to (a symlink's
target, the absolute directory a relative entry lies in) is where the file is read, never what an
error says: job errors are shown to whoever may read the job list.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

from ..confine import UnsafeFile, open_regular
from .bounded import LONE_SURROGATE, MAX_JSON_DEPTH, bounded_lines, lone_surrogate, too_deep
from .errors import DatasetError
from .regenerated import MANIFEST, regenerated_sources
from .source_file import SourceFile, child_name

SHARD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
# One record larger than this is refused: a single conversation of that size is a broken file,
# and reading it whole would cost host memory out of proportion.
MAX_RECORD_BYTES = 16 * 1024 * 1024
CONVERSATION_COLUMNS = ("messages", "conversations")
_READ_CHUNK = 1 << 20


def dataset_files(entry: str | Path, name: str | None = None) -> list[SourceFile]:
    """The files of one dataset entry, in reading order; DatasetError when it is unusable.
    name: how messages name the entry (default: the entry); a file found in a directory is named
    by it and the file's name."""
    path = Path(entry)
    label = str(entry) if name is None else name
    try:
        if path.is_dir():
            # a regeneration job's output (its complete shards), whatever its manifest turns out to be
            if os.path.lexists(path / MANIFEST):
                return regenerated_sources(path, label)
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                return [SourceFile(path, "arrow", label)]
            shards = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SHARD_SUFFIXES))
            if not shards:
                raise DatasetError(label, 0, "the directory holds no .jsonl, .jsonl.gz, .json or .parquet files")
            return [file_source(p, child_name(label, p.name)) for p in shards]
        if not path.is_file():
            there = os.path.lexists(path) and path.exists()  # a FIFO, a socket, a device: nothing to read
            raise DatasetError(label, 0, "is not a regular file or a directory" if there else "does not exist")
        return [file_source(path, label)]
    except OSError as e:
        raise unreadable(label, e) from None


def unreadable(name: str, error: OSError) -> DatasetError:
    """A dataset file the system refused to read, named as the user named it (an OSError's own
    text names the path that was opened)."""
    if isinstance(error, UnsafeFile):
        reason = str(error)
    elif error.strerror:  # the system's reason; its str() would name the resolved path
        reason = error.strerror
    else:  # a reader's own (pyarrow's on a damaged page): its message says what is wrong
        reason = f"{type(error).__name__}: {str(error)[:300]}" if str(error) else type(error).__name__
    return DatasetError(name, 0, f"cannot be read ({reason})")


def file_source(path: Path, name: str) -> SourceFile:
    if path.name.endswith(".jsonl.gz"):
        return SourceFile(path, "jsonl_gz", name)
    if path.suffix == ".parquet":
        return SourceFile(path, "parquet", name)
    if path.suffix == ".json":
        return SourceFile(path, "json_array" if _first_char(path) == "[" else "jsonl", name)
    return SourceFile(path, "jsonl", name)


def _first_char(path: Path) -> str:
    with open_regular(path, str(path)) as f:
        head = f.read(4096)
    text = head.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="replace").lstrip()
    return text[:1]


def iter_records(
    src: SourceFile, window: int | None = None, columns: tuple[str, ...] = CONVERSATION_COLUMNS
) -> Iterator[tuple[int, object]]:
    """(position, record or DatasetError) for every record of the file, in order; of a table,
    the first of `columns` it has (JSON records come whole). window: JSONL lines are read from the
    file's first `window` bytes only (a line the window cuts is not read)."""
    try:
        if src.kind == "jsonl":
            yield from _jsonl(src, window)
        elif src.kind == "jsonl_gz":
            yield from _jsonl_gz(src, window)
        elif src.kind == "json_array":
            yield from _json_array(src)
        elif src.kind == "parquet":
            yield from _parquet(src, columns)
        else:
            yield from _arrow(src, columns)
    except OSError as e:
        raise unreadable(src.name, e) from None


def _jsonl(src: SourceFile, window: int | None = None) -> Iterator[tuple[int, object]]:
    with open_regular(src.path, src.name) as f:
        yield from jsonl_lines(src.name, bounded_lines(f, MAX_RECORD_BYTES, window, partial_last=False), 1)


def _jsonl_gz(src: SourceFile, window: int | None = None) -> Iterator[tuple[int, object]]:
    """A gzip-compressed JSONL file, decompressed as it is read; `window` bounds the bytes
    decompressed. A corrupt or truncated stream is a DatasetError naming the file and the line
    it broke at, after the lines before it."""
    import gzip
    import zlib

    line = 0
    with open_regular(src.path, src.name) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
        lines = bounded_lines(cast(IO[bytes], f), MAX_RECORD_BYTES, window, partial_last=False)
        try:
            for line, record in jsonl_lines(src.name, lines, 1):
                yield line, record
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise DatasetError(src.name, line + 1, f"not a readable gzip stream ({e})") from None


def jsonl_lines(path: str, lines, first_line: int) -> Iterator[tuple[int, object]]:
    """JSON lines (bytes, newline kept; None for a line over MAX_RECORD_BYTES, see bounded_lines)
    numbered from `first_line`; `path` names the file in errors."""
    for line_no, raw in enumerate(lines, start=first_line):
        if raw is not None and line_no == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        if raw is None or len(raw) > MAX_RECORD_BYTES:
            yield line_no, DatasetError(path, line_no, f"line longer than {MAX_RECORD_BYTES >> 20} MiB")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield line_no, DatasetError(path, line_no, f"not UTF-8 text (byte {e.start} of the line)")
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield line_no, DatasetError(path, line_no, f"invalid JSON: {e.msg} (column {e.colno})")
            continue
        except RecursionError:
            record = _DEEP
        if record is _DEEP or too_deep(record):
            yield line_no, DatasetError(path, line_no, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            continue
        if lone_surrogate(text, record):
            yield line_no, DatasetError(path, line_no, LONE_SURROGATE)
            continue
        yield line_no, record


_DEEP = object()  # a value the JSON reader could not even build: nested past its recursion limit


def _json_array(src: SourceFile) -> Iterator[tuple[int, object]]:
    """Elements of a top-level JSON array, read incrementally (the file is never held whole)."""
    decoder = json.JSONDecoder()
    path = src.name  # in errors
    with open_regular(src.path, src.name) as f:
        reader = codecs.getincrementaldecoder("utf-8")()
        buf, pos, line, eof = "", 0, 1, False

        def more(size: int = _READ_CHUNK) -> bool:
            nonlocal buf, eof
            if eof:
                return False
            raw = f.read(size)
            eof = not raw
            try:
                buf += reader.decode(raw, final=eof)
            except UnicodeDecodeError as e:
                raise DatasetError(path, line, f"not UTF-8 text (byte {e.start} of a read block)") from None
            return True

        def skip_space() -> None:
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or not more():
                    return

        def compact() -> None:
            nonlocal buf, pos
            buf, pos = buf[pos:], 0

        try:
            skip_space()
            if buf[pos : pos + 1] != "[":
                raise DatasetError(path, line, "a .json dataset must be a JSON array or JSON lines")
            pos += 1
            skip_space()
            if buf[pos : pos + 1] == "]":
                return
            ordinal = 0
            while True:
                compact()
                start_line = line
                ordinal += 1
                while True:
                    try:
                        obj, end = decoder.raw_decode(buf, pos)
                        if end < len(buf) or not more():  # a number that ends the buffer may go on in the file
                            break
                        continue
                    except RecursionError:  # where it ends cannot be found: the error ends the file
                        raise DatasetError(
                            path, start_line, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
                        ) from None
                    except json.JSONDecodeError as e:
                        if _not_truncation(e, len(buf)):  # more of the file cannot mend it
                            raise DatasetError(path, start_line + e.lineno - 1, f"invalid JSON: {e.msg}") from None
                        have = _utf8_size(buf, pos, len(buf))  # bytes, as the bound and the reads count
                        if have > 2 * MAX_RECORD_BYTES:  # its end is not looked for further
                            raise DatasetError(
                                path, start_line, f"element larger than {MAX_RECORD_BYTES >> 20} MiB"
                            ) from None
                        # as much again as the element has so far (up to just past twice the bound):
                        # an element of n bytes is parsed about log(n) times, not once per block read
                        if not more(min(max(_READ_CHUNK, have), 2 * MAX_RECORD_BYTES + 1 - have)):
                            raise DatasetError(path, start_line + e.lineno - 1, f"invalid JSON: {e.msg}") from None
                line += buf.count("\n", pos, end)
                start, pos = pos, end
                # found whole within twice the bound: one bad record, and the next ones are read
                if _utf8_size(buf, start, end) > MAX_RECORD_BYTES:
                    yield ordinal, DatasetError(path, start_line, f"element larger than {MAX_RECORD_BYTES >> 20} MiB")
                elif too_deep(obj):
                    yield ordinal, DatasetError(path, start_line, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
                elif lone_surrogate(buf[start:end], obj):
                    yield ordinal, DatasetError(path, start_line, LONE_SURROGATE)
                else:
                    yield ordinal, obj
                skip_space()
                sep = buf[pos : pos + 1]
                if sep == "]":
                    return
                if sep != ",":
                    raise DatasetError(path, line, "expected ',' or ']' between array elements")
                pos += 1
                skip_space()
        except DatasetError as err:
            yield err.line, err  # the rest of the file cannot be located: the error ends it


def _not_truncation(error: json.JSONDecodeError, buffered: int) -> bool:
    """Whether a parse error lies far enough before the end of what is buffered that reading more
    cannot change it: an error that the end of the buffer causes (a literal, a number or an escape
    cut short) stands within a few characters of it, except an unterminated string, which may end
    anywhere further on."""
    return not error.msg.startswith("Unterminated string") and buffered - error.pos > 16


def batch_error(src: SourceFile, group: int, first: int, last: int, error: BaseException) -> DatasetError:
    """Rows first .. last of a parquet row group, read but not convertible (text that is not
    UTF-8), as the bad record at the first of them; the rows after them are read."""
    reason = " ".join(_named(error, src).split())[:300] or type(error).__name__
    return DatasetError(src.name, first, f"rows {first}-{last} of row group {group} cannot be read ({reason})", "row")


def _utf8_size(text: str, start: int, end: int) -> int:
    """The bytes text[start:end] takes in the file (encoded only where its characters alone could
    pass the record bound: a character is at most 4 bytes)."""
    if end - start <= MAX_RECORD_BYTES // 4:
        return end - start
    return len(text[start:end].encode("utf-8", "surrogatepass"))


def _conversation_column(names: list[str], path: str, columns: tuple[str, ...] = CONVERSATION_COLUMNS) -> str:
    for column in columns:
        if column in names:
            return column
    wanted = " or ".join(repr(c) for c in columns)
    raise DatasetError(path, 0, f"no {wanted} column (columns: {', '.join(names) or 'none'})")


def conversation_column(src: SourceFile) -> str:
    """The column holding the conversations of a parquet file or a save_to_disk directory."""
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(src.path).names
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
            raise DatasetError(src.name, 0, f"not a readable parquet file ({_named(e, src)})") from None
        return _conversation_column(names, src.name)
    return _conversation_column(list(load_arrow_dataset(src.path, src.name).column_names), src.name)


def _named(error: BaseException, src: SourceFile) -> str:
    """A reader's message about `src` with the path it opened replaced by the file's name."""
    return str(error).replace(str(src.path), src.name)


def _parquet(src: SourceFile, columns: tuple[str, ...]) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    with open_regular(src.path, src.name) as f:
        try:
            # buffered reads: a column chunk is read as its batches need it, not whole (a check of a
            # file's first records reads what they take of a row group that may hold the file)
            pf = pq.ParquetFile(f, buffer_size=1 << 20, pre_buffer=False)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
            raise DatasetError(src.name, 0, f"not a readable parquet file ({_named(e, src)})") from None
        column = _conversation_column(pf.schema_arrow.names, src.name, columns)
        first = 1  # the group's first row
        for group in range(pf.metadata.num_row_groups):
            count = pf.metadata.row_group(group).num_rows
            yield from _parquet_group(src, pf, group, column, first, count)
            first += count


def _parquet_group(src: SourceFile, pf, group: int, column: str, first: int, count: int):
    """The rows of one row group, numbered from `first`; a damaged page ends the group with one
    DatasetError naming it and the row it broke at (the next group is read: groups are apart)."""
    yield from GroupRows(src, pf, group, column, first, count).rows(first, first + count)


class GroupRows:
    """One parquet row group's rows (numbered from `first`), read forward in batches of 1,024 by
    any number of calls to rows(): the one-pass reader takes them all at once, a tokenization task
    the range it was given. A damaged page ends the group: one DatasetError at the row it broke
    at, or at a later call's first row. Text that is not UTF-8 (an uncompressed page) spoils one
    batch: a DatasetError for its rows, and the batches after it are read."""

    def __init__(self, src: SourceFile, pf, group: int, column: str, first: int, count: int):
        self.batches = pf.iter_batches(batch_size=1024, row_groups=[group], columns=[column])
        self.src, self.group, self.column, self.first, self.count = src, group, column, first, count
        self.next_row = first  # the row values[at] holds
        self.values: list = []
        self.at = 0
        self.error: BaseException | None = None

    def rows(self, first: int, stop: int) -> Iterator[tuple[int, object]]:
        """Rows first .. stop - 1 (those before `first` are passed over: decoded by Arrow, never
        turned into Python objects)."""
        while self.next_row < stop:
            if self.at == len(self.values):
                batch = None
                if self.error is None:
                    try:
                        batch = next(self.batches, None)
                    except (OSError, ValueError) as e:  # pyarrow's errors for a damaged page
                        self.error = e
                if batch is None:
                    break
                if self.next_row + batch.num_rows <= first:
                    self.next_row += batch.num_rows
                    continue
                try:
                    self.values, self.at = batch.column(0).to_pylist(), 0
                except ValueError as e:  # text that is not UTF-8: this batch's rows in the range
                    row = max(first, self.next_row)
                    last = min(self.next_row + batch.num_rows, stop) - 1
                    self.next_row += batch.num_rows
                    yield row, batch_error(self.src, self.group, row, last, e)
                    continue
            if self.next_row >= first:
                yield self.next_row, {self.column: self.values[self.at]}
            self.at += 1
            self.next_row += 1
        if self.error is not None and self.next_row < stop:
            row = max(first, self.next_row)
            yield row, row_group_error(self.src, self.group, self.first, self.count, self.error, row)


def row_group_error(
    src: SourceFile, group: int, first: int, count: int, error: BaseException, row: int | None = None
) -> DatasetError:
    """A parquet row group (rows first .. first + count - 1) that could not be read, from `row`
    on (default: its first), as the bad record at that row; the reader's message kept, on one line."""
    row = first if row is None else row
    reason = " ".join(_named(error, src).split())[:300] or type(error).__name__
    where = f"row group {group} (rows {first}-{first + count - 1}) cannot be read"
    return DatasetError(src.name, row, where + (f" from row {row}" if row > first else "") + f" ({reason})", "row")


def _arrow(src: SourceFile, columns: tuple[str, ...]) -> Iterator[tuple[int, object]]:
    dataset = load_arrow_dataset(src.path, src.name)
    column = _conversation_column(list(dataset.column_names), src.name, columns)
    row = 0
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        for value in batch[column]:
            row += 1
            yield row, {column: value}


def load_arrow_dataset(path: Path, name: str | None = None):
    """A `save_to_disk` directory as a Dataset (the `train` split of a DatasetDict); `name` names
    it in errors (default: the path)."""
    label = str(path) if name is None else name
    try:
        import datasets
    except ImportError:
        raise DatasetError(label, 0, "reading save_to_disk directories needs the `datasets` package") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for unreadable directories
        reason = str(e).replace(str(path), label)
        raise DatasetError(label, 0, f"not a readable datasets directory ({reason})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetError(label, 0, f"a DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded


def file_size(src: SourceFile) -> int:
    """Bytes of the file (all of a save_to_disk directory's arrow files): the unit of progress."""
    if src.kind == "arrow":
        return sum(p.stat().st_size for p in src.path.rglob("*.arrow"))
    return src.path.stat().st_size


def text_bytes(src: SourceFile) -> int:
    """About how many bytes the file holds once decompressed: what tokenizing it costs (a small
    compressed file may hold much text). A parquet file's row groups say it; a gzip stream's
    trailer gives its (last member's) size modulo 4 GiB, never taken below the file's own size."""
    size = file_size(src)
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            with open_regular(src.path, src.name) as f:
                meta = pq.ParquetFile(f).metadata
        except Exception:  # noqa: BLE001 - a damaged footer: the reading that follows names it
            return size
        return max(size, sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)))
    if src.kind == "jsonl_gz" and size >= 4:
        with open_regular(src.path, src.name) as f:
            f.seek(size - 4)
            return max(size, int.from_bytes(f.read(4), "little"))
    return size


def identity(src: SourceFile) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every file behind a source: what a cache key needs to notice a
    changed dataset without reading it."""
    files = sorted(p for p in src.path.rglob("*") if p.is_file()) if src.kind == "arrow" else [src.path]
    out = []
    for p in files:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return out
