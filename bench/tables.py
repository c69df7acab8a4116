"""The benchmarks' output folder and tables, apart from bench.common so that a tool which must not
import torch (bench.suite_cpu, beside the suite it measures) can print them."""

from __future__ import annotations

import os
from pathlib import Path


def out_dir() -> Path:
    p = Path(os.environ.get("OUT", "out"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def columns_of(rows: list[dict]) -> list[str]:
    """Every key of the rows, in the order they first appear."""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    return cols


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
