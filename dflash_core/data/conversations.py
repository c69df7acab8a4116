"""Read chat conversations from JSONL: OpenAI `messages` (role/content) or ShareGPT
`conversations` (from/value). Every problem names the file and the line."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .bounded import MAX_JSON_DEPTH, too_deep
from .errors import DatasetError
from .sources import SourceFile, dataset_files, iter_records

T = TypeVar("T")

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
}


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    source: str  # where it was read: "file:line" or "file row N"

    def error(self, reason: str) -> DatasetError:
        """A DatasetError at this conversation's place."""
        return DatasetError(self.source, 0, reason)


@dataclass
class ReadReport:
    lines_read: int = 0
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)

    def note_skip(self, err: DatasetError) -> None:
        self.skipped += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(str(err))


def parse_conversation(obj: object, path: str | Path, line: int, unit: str = "line") -> Conversation:
    def error(reason: str) -> DatasetError:
        return DatasetError(path, line, reason, unit)

    if not isinstance(obj, dict):
        raise error(f"expected a JSON object, got {type(obj).__name__}")
    if too_deep(obj):  # from any layout (parquet and save_to_disk rows too), before anything recurses into it
        raise error(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if "messages" in obj:
        raw, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        raw, role_key, text_key = obj["conversations"], "from", "value"
    else:
        raise error("no 'messages' (OpenAI) or 'conversations' (ShareGPT) field")
    if not isinstance(raw, list) or not raw:
        raise error("the message list is empty or not a list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise error(f"message {i} is not an object")
        role = ROLE_ALIASES.get(str(m.get(role_key, "")).lower())
        if role is None:  # the value itself is not echoed: errors are shown to whoever may list the jobs
            raise error(f"message {i} has an unknown {role_key!r} (expected one of: {', '.join(sorted(ROLE_ALIASES))})")
        text = m.get(text_key)
        if not isinstance(text, str):
            raise error(f"message {i} has no string {text_key!r}")
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise error("no assistant message: nothing to train on")
    return Conversation(messages, DatasetError(path, line, "", unit).where)


def read_conversations(
    path: str | Path, *, skip_bad_lines: bool = False, report: ReadReport | None = None, name: str | None = None
) -> Iterator[Conversation]:
    """The conversations of one dataset entry (any layout sources.py reads), in order; `name`
    names the entry in errors (default: the path)."""
    report = report if report is not None else ReadReport()
    for src in dataset_files(path, name):
        yield from parse_each(src, iter_records(src), parse_conversation, report, skip_bad_lines)


def parse_each(
    src: SourceFile,
    records: Iterable[tuple[int, object]],
    parse: Callable[[object, str, int, str], T],
    report: ReadReport,
    skip_bad_lines: bool,
) -> Iterator[T]:
    """parse(record, name, position, unit) of each of a source's records, counted in `report`;
    a bad record raises its DatasetError, or with skip_bad_lines is noted in `report` and skipped."""
    for position, record in records:
        report.lines_read += 1
        try:
            if isinstance(record, DatasetError):
                raise record
            yield parse(record, src.name, position, src.unit)
        except DatasetError as err:
            if not skip_bad_lines:
                raise
            report.note_skip(err)
