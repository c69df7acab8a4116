"""Read chat conversations from JSONL: OpenAI `messages` (role/content) or ShareGPT
`conversations` (from/value). Every problem names the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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


class DatasetError(ValueError):
    """A dataset line that cannot be used; str() names file and line."""

    def __init__(self, path: str | Path, line: int, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    source: str  # "file:line"


@dataclass
class ReadReport:
    lines_read: int = 0
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)

    def note_skip(self, err: DatasetError) -> None:
        self.skipped += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(str(err))


def parse_conversation(obj: object, path: str | Path, line: int) -> Conversation:
    if not isinstance(obj, dict):
        raise DatasetError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        raw, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        raw, role_key, text_key = obj["conversations"], "from", "value"
    else:
        raise DatasetError(path, line, "no 'messages' (OpenAI) or 'conversations' (ShareGPT) field")
    if not isinstance(raw, list) or not raw:
        raise DatasetError(path, line, "the message list is empty or not a list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise DatasetError(path, line, f"message {i} is not an object")
        role = ROLE_ALIASES.get(str(m.get(role_key, "")).lower())
        if role is None:
            raise DatasetError(path, line, f"message {i} has unknown {role_key!r} {m.get(role_key)!r}")
        text = m.get(text_key)
        if not isinstance(text, str):
            raise DatasetError(path, line, f"message {i} has no string {text_key!r}")
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(path, line, "no assistant message: nothing to train on")
    return Conversation(messages, f"{path}:{line}")


def read_conversations(
    path: str | Path, *, skip_bad_lines: bool = False, report: ReadReport | None = None
) -> Iterator[Conversation]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(path, 0, "file does not exist")
    report = report if report is not None else ReadReport()
    with path.open("r", encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            report.lines_read += 1
            try:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DatasetError(path, line_no, f"invalid JSON: {e.msg} (column {e.colno})") from None
                yield parse_conversation(obj, path, line_no)
            except DatasetError as err:
                if not skip_bad_lines:
                    raise
                report.note_skip(err)
