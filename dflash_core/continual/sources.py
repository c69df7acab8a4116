"""Watched sources: directories that a serving stack's request log or an RL trainer's rollout
writer appends to, read as they grow.

A poll lists each directory's record files (every layout the daemon reads: `.jsonl`, `.json`,
`.parquet`; names starting with a dot are a writer's temporary files and are left alone). A
JSONL file is read from where the last poll stopped up to its last complete line, so lines
appended to it arrive as they are written and a line still being written waits for its newline.
Any other file is read whole once its size and modification time held still over one poll
interval (a table written in place is complete by then; one renamed into place is complete at
once). Records come out through the daemon's own readers (data/sources.py), so a bad record is
named by file and line as in a training job.

How far each file was read is the watcher's cursor: it is saved beside each checkpoint
(state.py), so that a resumed job reads on from there and trains again only what came after.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..confine import ConfinedDir, OutsideRoots, resolved_under, under
from ..data.errors import DatasetError
from ..data.prompts import PROMPT_COLUMNS
from ..data.sources import MAX_RECORD_BYTES, SHARD_SUFFIXES, SourceFile, file_source, iter_records, jsonl_lines

# bytes of one JSONL file read per poll at most: a large backlog is read over several polls, so
# that one poll never holds a whole file in memory
READ_BYTES_PER_POLL = 8 << 20


def source_problem(source: str, dataset_roots: list[str], output_roots: list[str]) -> str | None:
    """Why a job cannot watch `source`, or None: it must be a directory under the dataset roots,
    or not exist yet where the job may create it (under the output roots: a source that a
    trainer's writer will fill, named before it wrote anything)."""
    real = resolved_under(source, dataset_roots, "source")
    if real.is_dir():
        return None
    if real.exists():
        return "not a directory (a source is a directory watched for new files)"
    if not output_roots or not under(real, [Path(os.path.realpath(r)) for r in output_roots]):
        return "does not exist (the job creates a missing source only under the output roots; create it first)"
    return None


def create_missing(source: str, output_roots: list[str]) -> bool:
    """Create a source that does not exist yet (source_problem allowed it) as a plain directory
    under the output roots, no symlink followed below the root; whether it was created."""
    if os.path.lexists(source):
        return False
    ConfinedDir(source, output_roots, "source").close()
    return True


@dataclass
class Record:
    source: str  # where it was read, as errors name it: "dir/file.jsonl:12"
    value: object  # the decoded record, or the DatasetError that stands in its place


class SourceWatcher:
    def __init__(self, directories: list[tuple[Path, str, list[str]]], cursor: dict[str, Any] | None):
        """directories: (directory, its name as the job gave it, the roots every file read in it
        must resolve under: empty, anywhere); cursor: a saved cursor()."""
        self.directories = directories
        self.files: dict[str, dict[str, Any]] = dict((cursor or {}).get("files", {}))
        self._seen: dict[str, tuple[int, int]] = {}  # non-JSONL files waiting to hold still: (size, mtime)

    def cursor(self) -> dict[str, Any]:
        return {"files": {k: dict(v) for k, v in self.files.items()}}

    def poll(self, enough: Callable[[], bool] = lambda: False) -> Generator[Record, None, None]:
        """The records that arrived since the last poll, file by file in name order; enough() is
        asked before each file, and True ends the poll there (the files after it are read at a
        later poll), so that a backlog of many files is not read into memory at once."""
        for directory, name, roots in self.directories:
            for parts, key, size in self._listing(directory):
                if enough():
                    return
                state = self.files.get(key, {})
                # refused (reported once), read whole already, or a JSONL file with nothing appended:
                # passed over on its listing's stat alone, so that a poll of many files stays cheap
                if "bad_size" in state and state["bad_size"] != size:  # a file that was no records grew
                    del self.files[key]
                    state = {}
                if state.get("refused") or state.get("done") or state.get("offset", -1) == size:
                    continue
                path = Path(key)
                label = "/".join((name.rstrip("/"), *parts))
                try:
                    real = resolved_under(path, roots, "a source file", label)
                    src = file_source(real, label)
                    if src.kind == "jsonl":
                        yield from self._appended(key, src)
                    else:
                        yield from self._whole(key, src)
                except OutsideRoots as e:
                    self.files[key] = {"done": True, "refused": True}
                    yield Record(label, DatasetError(label, 0, str(e)))
                except DatasetError as e:  # a whole file that is not records (a corrupt or foreign
                    # parquet, say): skipped and reported, as a bad line is, not the job's end; read
                    # again once its size changes (a writer that paused mid-file)
                    self.files[key] = {"done": True, "bad_size": size}
                    yield Record(label, e)
                except OSError as e:  # vanished or unreadable now: looked at again next poll
                    yield Record(label, DatasetError(label, 0, f"cannot be read ({e.strerror or type(e).__name__})"))

    def _listing(self, directory: Path) -> list[tuple[tuple[str, ...], str, int]]:
        """The record files under `directory` (symlinked directories not entered, dot names left
        alone), each as (its path's parts below the directory, its path, its size), in name order:
        one directory read per directory and one stat per file (a symlinked file's is its
        target's); strings, not Path objects, which cost more than the stat at many files."""
        found: list[tuple[tuple[str, ...], str, int]] = []
        pending: list[tuple[tuple[str, ...], str]] = [((), str(directory))]
        while pending:
            below, where = pending.pop()
            try:
                with os.scandir(where) as it:
                    entries = list(it)
            except OSError:  # vanished or unreadable now: looked at again next poll
                continue
            for entry in entries:
                try:
                    if entry.name.startswith("."):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(((*below, entry.name), entry.path))
                    elif os.path.splitext(entry.name)[1] in SHARD_SUFFIXES and entry.is_file():
                        found.append(((*below, entry.name), entry.path, entry.stat().st_size))
                except OSError:
                    continue
        return sorted(found)

    def _appended(self, key: str, src: SourceFile) -> Iterator[Record]:
        state = self.files.setdefault(key, {"offset": 0, "line": 1})
        size = os.path.getsize(src.path)
        if size < state["offset"]:  # truncated or replaced: read it again from its start
            state.update(offset=0, line=1)
        if size == state["offset"]:
            return
        with src.path.open("rb") as f:
            f.seek(state["offset"])
            chunk = f.read(min(size - state["offset"], READ_BYTES_PER_POLL))
            if b"\n" not in chunk and len(chunk) == READ_BYTES_PER_POLL:
                # one line longer than a poll's read: read on to where a record may end at most
                chunk += f.read(min(size - state["offset"], MAX_RECORD_BYTES + 1) - len(chunk))
        end = chunk.rfind(b"\n") + 1
        if end == 0:
            if len(chunk) > MAX_RECORD_BYTES or size - state["offset"] > MAX_RECORD_BYTES:
                # one line larger than a record may be: skipped, reported once at its place
                skip = self._skip_long_line(src.path, state["offset"])
                yield Record(f"{src.name}:{state['line']}", DatasetError(src.name, state["line"], "line too long"))
                state["offset"] = skip
                state["line"] += 1
            return
        # split on newlines only, as the daemon's JSONL readers do: a bare carriage return is JSON
        # whitespace inside a record, not the end of a line
        lines = chunk[:end].split(b"\n")[:-1]
        lines = [line + b"\n" for line in lines]
        base, first = state["offset"], state["line"]
        ends = list(itertools.accumulate(len(line) for line in lines))
        for line_no, value in jsonl_lines(src.name, lines, first):
            yield Record(f"{src.name}:{line_no}", value)
            # asked for the next one: this record was handled, so the cursor moves past its line
            state.update(offset=base + ends[line_no - first], line=line_no + 1)
        state.update(offset=base + end, line=first + len(lines))

    @staticmethod
    def _skip_long_line(path: Path, offset: int) -> int:
        """Where the line starting at `offset` ends (past its newline), or the file's end."""
        with path.open("rb") as f:
            f.seek(offset)
            while block := f.read(1 << 20):
                at = block.find(b"\n")
                if at >= 0:
                    return f.tell() - len(block) + at + 1
        return os.path.getsize(path)

    def _whole(self, key: str, src: SourceFile) -> Iterator[Record]:
        if self.files.get(key, {}).get("done"):
            return
        st = os.stat(src.path)
        now = (st.st_size, st.st_mtime_ns)
        if self._seen.get(key) != now:  # new or still changing: read once it held still a poll
            self._seen[key] = now
            return
        self._seen.pop(key, None)
        self.files[key] = {"done": True}
        for position, value in iter_records(src, columns=PROMPT_COLUMNS):
            yield Record(f"{src.name} {src.unit} {position}", value)


def drop_read_spool(directory: ConfinedDir, cursors: list[dict[str, Any]]) -> list[str]:
    """Remove the ingest spool's files (in `directory`) that every one of `cursors` read to their
    end, but the newest (still written to): what the ingest route accepted stays on disk exactly as
    long as a resume from one of those cursors may need it. The names removed."""
    from .job import spool_number

    numbered = sorted((n, e.name) for e in directory.entries() if (n := spool_number(e.name)) is not None)
    removed = []
    for _, name in numbered[:-1]:
        size = os.stat(name, dir_fd=directory.fd, follow_symlinks=False).st_size
        key = str(directory.path / name)
        if cursors and all(c.get("files", {}).get(key, {}).get("offset", -1) >= size for c in cursors):
            directory.remove_tree(name)
            removed.append(name)
    return removed
