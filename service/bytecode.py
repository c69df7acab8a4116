"""Where the daemon's Python keeps the bytecode it compiles from the libraries' sources.

Most of a warm start is importing torch (dynamo, inductor), sympy and transformers. Python reads
each module's compiled bytecode from a `__pycache__` beside its source, and where there is none it
compiles the source again at every start: in images whose site-packages were installed without
bytecode and are read-only (a read-only root filesystem, another user's install) or where
PYTHONDONTWRITEBYTECODE is set, that compiling is most of the import time.

So, before anything imports torch, `use_bytecode_cache` checks the heavy packages' bytecode. Where
it is present and current beside the sources, or Python can write it there itself, nothing
changes. Otherwise the process keeps its bytecode under the data directory (Python's
`pycache_prefix`, also exported to child processes such as inductor's compile workers): the first
start fills it, every later start on that data volume reads it. Nothing is written beside the
sources. An exported PYTHONPYCACHEPREFIX (or `-X pycache_prefix`) is the user's choice and is kept.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_core.trust import tree_problem

log = logging.getLogger("dflash.service")

# source files on a warm start's import path, relative to their top-level package's directory
PROBES: dict[str, tuple[str, ...]] = {
    "torch": ("__init__.py", "_dynamo/__init__.py", "_inductor/compile_fx.py"),
    "sympy": ("__init__.py",),
    "transformers": ("__init__.py", "modeling_utils.py"),
}


@dataclass(frozen=True)
class BytecodeCache:
    directory: str | None  # the prefix in effect; None: beside the sources, as Python does by default
    reason: str


def use_bytecode_cache(directory: Path, probes: dict[str, tuple[str, ...]] = PROBES) -> BytecodeCache:
    """Keep this process's compiled bytecode under `directory` when the probed packages' sources
    have no current bytecode beside them that Python could read or write (module docstring). Must
    run before those packages are imported. Logs where bytecode is kept and why."""
    if sys.pycache_prefix is not None:
        out = BytecodeCache(sys.pycache_prefix, "the user's: PYTHONPYCACHEPREFIX exported or -X pycache_prefix")
    else:
        missing = [str(src) for src in _probe_sources(probes) if not _current(src)]
        unwritable = [src for src in missing if not _writable_beside(Path(src))]
        if not missing:
            out = BytecodeCache(None, "the libraries' bytecode is beside their sources")
        elif not unwritable:
            out = BytecodeCache(None, "Python writes the libraries' bytecode beside their sources")
        else:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                usable = os.access(directory, os.W_OK | os.X_OK)
                problem = "not writable by this process"
            except OSError as e:  # the daemon reports an unusable data directory itself, by its own rules
                usable, problem = False, f"cannot create it: {e}"
            if not usable:
                # a prefix Python cannot write would also hide the bytecode beside every other source
                log.warning("python bytecode: %s: %s; compiling the libraries' sources", directory, problem)
                return BytecodeCache(None, f"{directory}: {problem}")
            # bytecode read from the data volume runs as the daemon: only what the daemon's user wrote
            if (untrusted := tree_problem(directory, directory.parent)) is not None:
                log.error(
                    "python bytecode: refusing %s: %s (see the README's trust boundary); compiling the libraries' "
                    "sources",
                    directory,
                    untrusted,
                )
                return BytecodeCache(None, f"refused: {untrusted}")
            why = "bytecode writing is off: PYTHONDONTWRITEBYTECODE or -B" if sys.dont_write_bytecode else "read-only"
            sys.pycache_prefix = str(directory)
            # a prefix writes nothing beside the sources, which is what PYTHONDONTWRITEBYTECODE
            # protects; children (inductor's compile workers) write to it too
            os.environ["PYTHONPYCACHEPREFIX"] = str(directory)
            os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
            sys.dont_write_bytecode = False
            out = BytecodeCache(
                str(directory), f"no current bytecode beside {unwritable[0]} and Python cannot write it there ({why})"
            )
    log.info(
        "python bytecode: %s (%s)",
        out.directory or "beside the sources",
        out.reason,
        extra={"fields": {"directory": out.directory}},
    )
    return out


def _probe_sources(probes: dict[str, tuple[str, ...]]) -> list[Path]:
    """The probed files that exist (a top-level spec lookup does not import the package)."""
    out: list[Path] = []
    for package, files in probes.items():
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # a broken install, or a module already imported without a spec
            continue
        if spec is None or spec.origin is None or spec.submodule_search_locations is None:
            continue
        root = Path(spec.origin).parent
        out.extend(p for p in (root / f for f in files) if p.is_file())
    return out


def _current(source: Path) -> bool:
    """Whether the bytecode beside `source` is what Python would accept for it (PEP 552): its
    magic number and flags, then the source's mtime and size, or for a checked hash-based pyc the
    source's hash (an unchecked one is accepted as it is)."""
    try:
        pyc = importlib.util.cache_from_source(str(source))
        with open(pyc, "rb") as f:
            head = f.read(16)
        st = source.stat()
    except (OSError, NotImplementedError):  # no readable pyc, or an interpreter that caches no bytecode
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(head[4:8], "little")
    if flags & ~0b11:
        return False
    if flags & 0b1:  # hash-based
        if not flags & 0b10:
            return True
        try:
            return importlib.util.source_hash(source.read_bytes()) == head[8:16]
        except OSError:
            return False
    mtime, size = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
    return mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def _writable_beside(source: Path) -> bool:
    """Whether this process would write the bytecode of `source` beside it."""
    if sys.dont_write_bytecode:
        return False
    cache = source.parent / "__pycache__"
    return os.access(cache if cache.is_dir() else source.parent, os.W_OK)
