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
    ~/.local/share, then dflash-trainer); never the current directory: a relative XDG_DATA_HOME
    is ignored, as the XDG spec says, and a relative HOME gives way to the user's home directory
    in the password database."""
    if env.get("DFLASH_DATA_DIR"):
        return Path(env["DFLASH_DATA_DIR"]).expanduser()
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else _home(env) / ".local" / "share"
    return base / "dflash-trainer"


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME", "")
    if os.path.isabs(home):
        return Path(home)
    import pwd

    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # a user the system does not list (a container's arbitrary uid)
        raise ValueError(
            "no data directory: HOME is not an absolute path and the user has no home directory; "
            "set DFLASH_DATA_DIR or pass --data-dir"
        ) from None
