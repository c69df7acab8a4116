"""Where the daemon keeps its data when no data directory is given: one rule for the daemon and
for the tools that write into its data directory (`make smollm2`), so both find the same place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$DFLASH_DATA_DIR, else the per-user data directory ($XDG_DATA_HOME, else
    ~/.local/share, then dflash-trainer); never the current directory."""
    if env.get("DFLASH_DATA_DIR"):
        return Path(env["DFLASH_DATA_DIR"]).expanduser()
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    base = env.get("XDG_DATA_HOME") or str(home / ".local" / "share")
    return Path(base).expanduser() / "dflash-trainer"
