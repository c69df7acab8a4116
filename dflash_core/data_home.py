"""Where the daemon keeps its data when no data directory is given: one rule for the daemon and
for the tools that write into its data directory (`make smollm2`), so both find the same place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# what the daemon keeps in its data directory beside the job store and the jobs' default output
# directories (jobs/): no job writes into them
ASSETS_DIR = "defaults"  # the embedded default target, tokenizer and datasets
CACHE_DIR = "cache"  # tokenized datasets, the saved tokenizer
INDUCTOR_CACHE_DIR = "inductor-cache"  # compiled kernels (unless inductor_cache_dir says otherwise)
BYTECODE_DIR = "python-cache"  # the libraries' bytecode where it cannot live beside them
RANKS_DIR = "ranks"  # the data directories of a multi-host group's other ranks
DAEMON_DIRS = (ASSETS_DIR, CACHE_DIR, INDUCTOR_CACHE_DIR, BYTECODE_DIR, RANKS_DIR)


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$DFLASH_DATA_DIR, else the per-user data directory ($XDG_DATA_HOME, else
    ~/.local/share, then dflash-trainer); never the current directory."""
    if env.get("DFLASH_DATA_DIR"):
        return Path(env["DFLASH_DATA_DIR"]).expanduser()
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    base = env.get("XDG_DATA_HOME") or str(home / ".local" / "share")
    return Path(base).expanduser() / "dflash-trainer"
