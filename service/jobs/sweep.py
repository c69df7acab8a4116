"""What interrupted checkpoint writes leave behind, removed before the worker takes a job.

dflash_core.checkpoint writes into a temporary directory and swaps it in by renames; a process
killed meanwhile leaves the temporary directory (up to a whole checkpoint) in
<output_dir>/checkpoints. The engine sweeps a job's directory whenever it runs the job; this sweeps
every output directory the store knows, ended jobs' included, once at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from .paths import Roots
from .store import JobStore, StoreUnavailable

log = logging.getLogger("dflash.jobs")

# the names the engine's own sweep (dflash_core.engine.checkpointing.sweep_partial_writes) removes:
# never a checkpoint a resume reads
PARTIAL_CHECKPOINT_PREFIXES = (".tmp-step-", ".old-step-")


def sweep_all_partial_checkpoints(store: JobStore, roots: Roots) -> None:
    """Before any job runs (nothing writes a checkpoint yet): every output directory the store knows."""
    try:
        output_dirs = store.output_dirs()
    except StoreUnavailable as e:
        log.warning("could not list the jobs' output directories to sweep", extra={"fields": {"error": str(e)}})
        return
    for output_dir in output_dirs:
        sweep_partial_checkpoints(output_dir, roots)


def sweep_partial_checkpoints(output_dir: str, roots: Roots) -> list[str]:
    """Remove what interrupted checkpoint writes left in <output_dir>/checkpoints; only where
    that directory, symlinks resolved, lies under the configured output roots. Creates nothing
    (most jobs' directories are gone or were never made)."""
    directory = Path(output_dir) / "checkpoints"
    try:
        real = directory.resolve()
        if not roots.holds_output(real):
            return []
        with os.scandir(real) as it:
            partial = [
                e for e in it if e.name.startswith(PARTIAL_CHECKPOINT_PREFIXES) and e.is_dir(follow_symlinks=False)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        log.warning(
            "could not sweep partial checkpoint writes",
            extra={"fields": {"directory": str(directory), "error": str(e)}},
        )
        return []
    removed, freed = [], 0
    for entry in partial:
        size = _tree_bytes(entry.path)
        try:
            shutil.rmtree(entry.path)
        except OSError as e:
            log.warning(
                "could not remove a partial checkpoint write",
                extra={"fields": {"path": entry.path, "error": str(e)}},
            )
            continue
        removed.append(entry.path)
        freed += size
    if removed:
        log.info(
            "removed partial checkpoint writes",
            extra={"fields": {"directory": str(real), "names": [Path(p).name for p in removed], "bytes": freed}},
        )
    return removed


def _tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (symlinks not followed)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile: nothing to count
                total += os.lstat(os.path.join(parent, name)).st_size
    return total
