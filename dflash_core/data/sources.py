"""Where conversations come from: the dataset layouts users keep, read record by record.

A dataset entry is one of
  * a JSONL file (`.jsonl`, or a `.json` file whose first character is not `[`),
  * a JSON array file (`.json` starting with `[`),
  * a parquet file (`.parquet`),
  * a directory written by `datasets.Dataset.save_to_disk` (or a `DatasetDict`, whose `train`
    split is used),
  * a directory of shards: its `*.jsonl`, `*.json` and `*.parquet` files, in sorted order.
Every record is a conversation in OpenAI `messages` or ShareGPT `conversations` form
(conversations.py). Parquet and `save_to_disk` data are read with pyarrow and HF `datasets`;
JSON text is read here, line by line or element by element, because a broken record must be
reported by file and line, and a JSON reader that parses a whole file at once cannot say where.

Records come out as (position, record) pairs, the position being the line (JSONL), the element's
ordinal (JSON arrays; a syntax error is reported by line) or the row (parquet, `save_to_disk`); a
record that cannot
be read comes out as a DatasetError in its place, so that the caller decides whether to skip it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .conversations import DatasetError

SHARD_SUFFIXES = (".jsonl", ".json", ".parquet")
# One record larger than this is refused: a single conversation of that size is a broken file,
# and reading it whole would cost host memory out of proportion.
MAX_RECORD_BYTES = 16 * 1024 * 1024
CONVERSATION_COLUMNS = ("messages", "conversations")
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: str  # jsonl | json_array | parquet | arrow

    @property
    def unit(self) -> str:
        """How positions in this file are counted in messages: lines of JSONL, elements of a JSON
        array (several can share a line), rows of tables."""
        return {"jsonl": "line", "json_array": "element"}.get(self.kind, "row")


def dataset_files(entry: str | Path) -> list[SourceFile]:
    """The files of one dataset entry, in reading order; DatasetError when it is unusable."""
    path = Path(entry)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return [SourceFile(path, "arrow")]
        shards = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)
        if not shards:
            raise DatasetError(path, 0, "the directory holds no .jsonl, .json or .parquet files")
        return [_file_source(p) for p in shards]
    if not path.is_file():
        raise DatasetError(path, 0, "does not exist")
    return [_file_source(path)]


def _file_source(path: Path) -> SourceFile:
    if path.suffix == ".parquet":
        return SourceFile(path, "parquet")
    if path.suffix == ".json":
        return SourceFile(path, "json_array" if _first_char(path) == "[" else "jsonl")
    return SourceFile(path, "jsonl")


def _first_char(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(4096)
    text = head.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="replace").lstrip()
    return text[:1]


def iter_records(src: SourceFile) -> Iterator[tuple[int, object]]:
    """(position, record or DatasetError) for every record of the file, in order."""
    if src.kind == "jsonl":
        yield from _jsonl(src.path)
    elif src.kind == "json_array":
        yield from _json_array(src.path)
    elif src.kind == "parquet":
        yield from _parquet(src.path)
    else:
        yield from _arrow(src.path)


def _jsonl(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("rb") as f:
        yield from _jsonl_lines(path, f, 1)


def _jsonl_lines(path: Path, lines, first_line: int) -> Iterator[tuple[int, object]]:
    """JSON lines (bytes, newline kept) numbered from `first_line`."""
    for line_no, raw in enumerate(lines, start=first_line):
        if line_no == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        if len(raw) > MAX_RECORD_BYTES:
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
            yield line_no, json.loads(text)
        except json.JSONDecodeError as e:
            yield line_no, DatasetError(path, line_no, f"invalid JSON: {e.msg} (column {e.colno})")


def _json_array(path: Path) -> Iterator[tuple[int, object]]:
    """Elements of a top-level JSON array, read incrementally (the file is never held whole)."""
    decoder = json.JSONDecoder()
    with path.open("rb") as f:
        reader = codecs.getincrementaldecoder("utf-8")()
        buf, pos, line, eof = "", 0, 1, False

        def more() -> bool:
            nonlocal buf, eof
            if eof:
                return False
            raw = f.read(_READ_CHUNK)
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
                        break
                    except json.JSONDecodeError as e:
                        if len(buf) - pos > MAX_RECORD_BYTES:
                            raise DatasetError(
                                path, start_line, f"element larger than {MAX_RECORD_BYTES >> 20} MiB"
                            ) from None
                        if not more():
                            raise DatasetError(path, start_line + e.lineno - 1, f"invalid JSON: {e.msg}") from None
                line += buf.count("\n", pos, end)
                pos = end
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


def _conversation_column(names: list[str], path: Path) -> str:
    for column in CONVERSATION_COLUMNS:
        if column in names:
            return column
    raise DatasetError(path, 0, f"no 'messages' or 'conversations' column (columns: {', '.join(names) or 'none'})")


def conversation_column(src: SourceFile) -> str:
    """The column holding the conversations of a parquet file or a save_to_disk directory."""
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(src.path).names
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
            raise DatasetError(src.path, 0, f"not a readable parquet file ({e})") from None
        return _conversation_column(names, src.path)
    return _conversation_column(list(load_arrow_dataset(src.path).column_names), src.path)


def _parquet(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise DatasetError(path, 0, f"not a readable parquet file ({e})") from None
    column = _conversation_column(pf.schema_arrow.names, path)
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[column]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield row, {column: value}


def _arrow(path: Path) -> Iterator[tuple[int, object]]:
    dataset = load_arrow_dataset(path)
    column = _conversation_column(list(dataset.column_names), path)
    row = 0
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        for value in batch[column]:
            row += 1
            yield row, {column: value}


def load_arrow_dataset(path: Path):
    """A `save_to_disk` directory as a Dataset (the `train` split of a DatasetDict)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(path, 0, "reading save_to_disk directories needs the `datasets` package") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for unreadable directories
        raise DatasetError(path, 0, f"not a readable datasets directory ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetError(path, 0, f"a DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded


def file_size(src: SourceFile) -> int:
    """Bytes of the file (all of a save_to_disk directory's arrow files): the unit of progress."""
    if src.kind == "arrow":
        return sum(p.stat().st_size for p in src.path.rglob("*.arrow"))
    return src.path.stat().st_size


def identity(src: SourceFile) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of every file behind a source: what a cache key needs to notice a
    changed dataset without reading it."""
    files = sorted(p for p in src.path.rglob("*") if p.is_file()) if src.kind == "arrow" else [src.path]
    out = []
    for p in files:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return out
