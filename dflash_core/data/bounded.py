"""Reads with their bound applied while reading, not after: a line is never held longer than the
limit (a 1 GB file without a newline costs one limit's worth of memory, not a gigabyte), and a
parsed JSON value is refused past a nesting depth before anything walks it recursively (a deep
value would otherwise end in a bare RecursionError far from the file and line it came from).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, Any

SCAN_BLOCK = 1 << 20
# Conversations are a list of messages of a few fields; request bodies and template options a few
# levels more. Far below the depth at which Python's JSON encoder, pydantic or Jinja recurse out.
MAX_JSON_DEPTH = 32
LONE_SURROGATE = "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff): not text"
# a JSON escape of a UTF-16 surrogate, the only way one gets into a parsed string (the bytes of
# one are not UTF-8); a pair of them (an emoji, say) parses to one character and passes
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def bounded_lines(
    f: IO[bytes], limit: int, end: int | None = None, *, partial_last: bool = True
) -> Iterator[bytes | None]:
    """The lines of binary file `f` from its position up to byte offset `end` (None: its end), each
    with its newline; None in place of a line longer than `limit` bytes, which is skipped without
    being held in memory. partial_last=False: a last line that `end` cuts (no newline) is dropped,
    for a reader that looks at a window of the file rather than a range ending on a line."""
    pos = f.tell()
    while end is None or pos < end:
        want = limit + 1 if end is None else min(limit + 1, end - pos)
        line = f.readline(want)
        if not line:
            return
        pos += len(line)
        if len(line) <= limit:
            if partial_last or line.endswith(b"\n") or end is None:
                yield line
            continue
        yield None  # first: a reader that stops at this error never reads the rest of the line
        while not line.endswith(b"\n"):  # the rest of the long line, block by block
            line = f.readline(SCAN_BLOCK if end is None else min(SCAN_BLOCK, max(0, end - pos)))
            if not line:
                break
            pos += len(line)


def next_line_start(f: IO[bytes], offset: int, size: int) -> int:
    """The offset just past the first newline at or after `offset` (or `size`), scanned block by block."""
    f.seek(offset)
    while offset < size:
        block = f.read(min(SCAN_BLOCK, size - offset))
        if not block:
            return size
        i = block.find(b"\n")
        if i >= 0:
            return offset + i + 1
        offset += len(block)
    return size


def count_newlines(f: IO[bytes], start: int, end: int) -> int:
    f.seek(start)
    count = 0
    while start < end:
        block = f.read(min(SCAN_BLOCK, end - start))
        if not block:
            break
        count += block.count(b"\n")
        start += len(block)
    return count


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests objects and arrays deeper than `limit` (walked with a
    stack of its own, never by recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def lone_surrogate(raw: str, value: Any) -> bool:
    """Whether `value`, parsed from the JSON text `raw`, holds a string (a key or a value) with an
    unpaired UTF-16 surrogate: JSON lets an escape give one, but no text encoding takes it, so a
    tokenizer or a UTF-8 writer would fail on it far from the line it came from. Walked only where
    `raw` has such an escape at all."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return False
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False
