"""Prompts for regeneration, from any dataset layout sources.py reads: a conversation (OpenAI
`messages` or ShareGPT `conversations`) up to and including its last user turn, or a `prompt`
field (a string, taken as one user turn, or a message list). Every problem names the file and the
line or row, as conversations.py does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .conversations import ROLE_ALIASES, DatasetError, ReadReport, parse_each

PROMPT_COLUMNS = ("messages", "conversations", "prompt")


@dataclass
class Prompt:
    messages: list[dict[str, str]]  # the turns the target answers, ending with a user turn
    source: str  # "file:line" or "file row N"


def _messages(raw: object, role_key: str, text_key: str, error) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise error("the message list is empty or not a list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise error(f"message {i} is not an object")
        role = ROLE_ALIASES.get(str(m.get(role_key, "")).lower())
        if role is None:
            raise error(f"message {i} has unknown {role_key!r} {m.get(role_key)!r}")
        text = m.get(text_key)
        if not isinstance(text, str):
            raise error(f"message {i} has no string {text_key!r}")
        out.append({"role": role, "content": text})
    return out


def parse_prompt(obj: object, path: str | Path, line: int, unit: str = "line") -> Prompt:
    def error(reason: str) -> DatasetError:
        return DatasetError(path, line, reason, unit)

    if not isinstance(obj, dict):
        raise error(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj and obj["messages"] is not None:
        messages = _messages(obj["messages"], "role", "content", error)
    elif "conversations" in obj and obj["conversations"] is not None:
        messages = _messages(obj["conversations"], "from", "value", error)
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise error("the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _messages(prompt, "role", "content", error)
    else:
        raise error("no 'messages' (OpenAI), 'conversations' (ShareGPT) or 'prompt' field")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise error("no user turn: nothing to answer")
    return Prompt(messages[: last_user + 1], DatasetError(path, line, "", unit).where)


def read_prompts(
    path: str | Path,
    *,
    skip_bad_lines: bool = False,
    report: ReadReport | None = None,
    name: str | None = None,
    roots: list[str] | list[Path] | None = None,
) -> Iterator[Prompt]:
    """The prompts of one dataset entry, in order; `name` names the entry in errors. Each file
    the entry holds must lie under `roots` (a symlinked file in a dataset directory is refused
    as training refuses it); no roots: no confinement."""
    from ..confine import resolved_under
    from .sources import dataset_files, iter_records

    report = report if report is not None else ReadReport()
    for listed in dataset_files(path, name):
        src = replace(listed, path=resolved_under(listed.path, roots or [], "a dataset file", listed.name))
        yield from parse_each(src, iter_records(src, columns=PROMPT_COLUMNS), parse_prompt, report, skip_bad_lines)
