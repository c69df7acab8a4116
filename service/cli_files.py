"""The files the client commands read before any request (a job spec, a records file), checked
here: a file that cannot be used is a BadArgument naming it, and the line where one is at fault,
never a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, BinaryIO

from .client import BadArgument


def open_file(path: Path) -> BinaryIO:
    """`path` opened for reading, which must be a regular file (a FIFO would wait for a writer)."""
    try:
        if path.is_dir():
            raise BadArgument(f"{path}: a directory, not a file")
        if path.exists() and not path.is_file():
            raise BadArgument(f"{path}: not a regular file")
        return path.open("rb")
    except FileNotFoundError:
        raise BadArgument(f"{path}: no such file") from None
    except OSError as e:
        raise BadArgument(f"{path}: cannot read it: {e.strerror or e}") from None


def read_bytes(path: Path) -> bytes:
    with open_file(path) as f:
        try:
            return f.read()
        except OSError as e:
            raise BadArgument(f"{path}: cannot read it: {e.strerror or e}") from None


def _json_name(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def read_json_object(path: Path) -> dict[str, Any]:
    """A file holding one JSON object (a job spec). Numbers must be finite: JSON has no NaN or
    infinity, which the daemon could not be sent."""

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise BadArgument(f"{path}: {text} is out of range for a number")
        return value

    def no_constant(name: str) -> float:
        raise BadArgument(f"{path}: {name} is not JSON")

    raw = read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadArgument(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        value = json.loads(text, parse_float=finite, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise BadArgument(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except RecursionError:
        raise BadArgument(f"{path}: nested too deep") from None
    if not isinstance(value, dict):
        raise BadArgument(f"{path}: a job spec is a JSON object ({{...}}), not {_json_name(value)}")
    return value
