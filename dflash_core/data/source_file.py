"""One file of a dataset as the readers see it (where it is read, its layout, how messages name
it), and how a file found under a dataset entry is named: what both the dataset layouts
(sources.py) and a regeneration's output (regenerated.py) build, without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceFile:
    path: Path  # where it is read
    kind: str  # jsonl | json_array | parquet | arrow
    name: str = ""  # how messages name it (default: the path)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", str(self.path))

    @property
    def unit(self) -> str:
        """How positions in this file are counted in messages: lines of JSONL, elements of a JSON
        array (several can share a line), rows of tables."""
        return {"jsonl": "line", "jsonl_gz": "line", "json_array": "element"}.get(self.kind, "row")


def child_name(entry_name: str, relative: str) -> str:
    """How messages name a file found under a dataset entry named `entry_name`."""
    return entry_name + relative if entry_name.endswith("/") else f"{entry_name}/{relative}"
