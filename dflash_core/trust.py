"""The data directory is as trusted as the code: the daemon loads and runs what it finds there
(compile artifacts and inductor's compiled kernels, the Python bytecode cache, the job store whose
records name paths and roots). So, as sshd's StrictModes does, each such artefact is used only
when it, and every directory between the data directory and it, is owned by the daemon's user
(or root) and writable by no other user than that owner and its group; the data directory itself
must not be writable by every user unless it is sticky. Group write is allowed: a Kubernetes
`fsGroup` volume is group-writable by design, and the daemon's own files on it carry that group.

Callers refuse an artefact that fails and say why (`problem`, `tree_problem`): a cache is then
not read (the daemon starts cold), the job store stops the daemon.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# a tree walk gives up (and refuses) past this many entries: a cache that large was not ours to trust
MAX_TREE_ENTRIES = 500_000


def _entry_problem(path: Path, st: os.stat_result, top: bool = False) -> str | None:
    uid = os.geteuid()
    if not top and st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by the daemon's user (uid {uid}) or root"
    world_writable = bool(st.st_mode & stat.S_IWOTH)
    sticky_dir = stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX)
    if world_writable and not (top and sticky_dir):
        return f"{path} is writable by every user (mode {stat.filemode(st.st_mode)})"
    return None


def problem(path: Path, data_dir: Path) -> str | None:
    """Why the artefact at `path` (under `data_dir`) must not be loaded; None when it may be, or
    when it does not exist. A symlink is refused: what it leads to was not checked."""
    data_dir = Path(os.path.abspath(data_dir))
    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path} cannot be checked ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    chain = [path]
    if path.is_relative_to(data_dir):
        chain += [p for p in path.parents if p.is_relative_to(data_dir)]
    for p in chain:
        try:
            info = st if p == path else os.lstat(p)
        except OSError as e:
            return f"{p} cannot be checked ({e.strerror or e})"
        if p != path and stat.S_ISLNK(info.st_mode) and p != data_dir:
            return f"{p} is a symlink"
        if (why := _entry_problem(p, info, top=p == data_dir)) is not None:
            return why
    return None


def tree_problem(root: Path, data_dir: Path) -> str | None:
    """`problem` for a directory and everything in it (symlinks inside are not followed: they
    are refused too)."""
    if (why := problem(root, data_dir)) is not None:
        return why
    seen = 0
    stack = [Path(os.path.abspath(root))]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except NotADirectoryError:
            continue
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{directory} cannot be listed ({e.strerror or e})"
        for entry in entries:
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                return f"{root} holds more than {MAX_TREE_ENTRIES} entries; not checked"
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                return f"{entry.path} cannot be checked ({e.strerror or e})"
            if stat.S_ISLNK(st.st_mode):
                return f"{entry.path} is a symlink"
            if (why := _entry_problem(Path(entry.path), st)) is not None:
                return why
            if stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
    return None
