"""Reads and writes stay under the configured roots when they happen, not only when a job was
submitted: a path checked at submission can be swapped for a symlink while the job waits.

Reading: a path is resolved again (symlinks followed) right before use and must still lie under
a dataset root; what is read is the resolved path. Writing: an output directory is opened by a
walk from its root that follows no symlink (`O_NOFOLLOW` on every component below the root) and
is then used through its file descriptor: directories are created, renamed and deleted relative
to it, so a component swapped for a symlink later cannot redirect a write or a deletion.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class OutsideRoots(PermissionError):
    """A path that resolves outside the roots it must stay under; the message names the path as
    the user gave it, not where it leads."""


def under(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def resolved_under(path: str | Path, roots: list[str] | list[Path], what: str, name: str | None = None) -> Path:
    """`path` resolved now (symlinks followed), which must lie under one of `roots`; no roots:
    no confinement (a caller outside the daemon, such as the eval command). name: how the error
    names the path (default: the path)."""
    if not roots:
        return Path(path)
    real = Path(os.path.realpath(path))
    if not under(real, [Path(os.path.realpath(r)) for r in roots]):
        label = str(path) if name is None else name
        raise OutsideRoots(f"{what} {label!r} now resolves outside the allowed roots; it changed after submission")
    return real


class ConfinedDir:
    """A directory under one of `roots`, reached without following symlinks below the root,
    created if missing, and held open: every operation inside it goes through its descriptor."""

    def __init__(self, path: str | Path, roots: list[str] | list[Path], what: str = "output_dir"):
        # unconfined (no roots): the path as it resolves now, walked from the filesystem root
        path = Path(os.path.abspath(path)) if roots else Path(os.path.realpath(path))
        real_roots = [Path(os.path.realpath(r)) for r in roots] or [Path(path.anchor)]
        root = next((r for r in sorted(real_roots, key=lambda r: -len(r.parts)) if under(path, [r])), None)
        if root is None:
            raise OutsideRoots(f"{what} {str(path)!r} is outside the allowed roots")
        self.path = path
        self.what = what
        fd = os.open(root, _DIR_FLAGS)
        try:
            for part in path.relative_to(root).parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    child = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno in (40, 20):  # ELOOP (a symlink), ENOTDIR
                        raise OutsideRoots(
                            f"{what} {str(path)!r}: {part!r} is not a plain directory (a symlink or a file); "
                            "refusing to write through it"
                        ) from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def at(self, name: str) -> str:
        """A path that reaches `name` inside this directory through its descriptor (Linux)."""
        return f"/proc/self/fd/{self.fd}/{name}"

    def entries(self) -> Iterator[os.DirEntry]:
        with os.scandir(self.fd) as it:
            yield from it

    def mkdir_private(self, name: str) -> ConfinedDir:
        os.mkdir(name, 0o700, dir_fd=self.fd)
        child = object.__new__(ConfinedDir)
        child.path, child.what = self.path / name, self.what
        child.fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=self.fd)
        return child

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def remove_tree(self, name: str) -> None:
        """Delete `name` inside this directory: a directory with everything in it (never following
        a symlink), or the symlink or file itself."""
        st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def free_bytes(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize

    def __enter__(self) -> ConfinedDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def confinement_available() -> bool:
    """Whether descriptors can be reached by path (/proc/self/fd), which ConfinedDir.at needs."""
    return Path("/proc/self/fd").is_dir()
