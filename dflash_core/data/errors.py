"""The error every dataset reader raises, in a module of its own so that the readers of
layouts (sources.py) and of records (conversations.py) both use it without importing each other."""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """A dataset record that cannot be used; str() names the file and the line or row."""

    def __init__(self, path: str | Path, line: int, reason: str, unit: str = "line"):
        self.path, self.line, self.reason, self.unit = str(path), line, reason, unit
        super().__init__(f"{self.where}: {reason}")

    @property
    def where(self) -> str:
        if self.line <= 0:
            return self.path
        return f"{self.path}:{self.line}" if self.unit == "line" else f"{self.path} {self.unit} {self.line}"
