"""Reads and writes stay under the configured roots when they happen, not only when a job was
submitted: a path checked at submission can be swapped for a symlink while the job waits.

Reading: a path is resolved again (symlinks followed) right before use and must still lie under
a dataset root; what is read is the resolved path. Writing: an output directory is opened by a
walk from its root that follows no symlink (`O_NOFOLLOW` on every component below the root) and
is then used through its file descriptor: directories are created, renamed and deleted relative
to it, so a component swapped for a symlink later cannot redirect a write or a deletion. A file
is written only when this process created it (`O_CREAT|O_EXCL|O_NOFOLLOW` relative to such a
descriptor), so a name planted beforehand, a symlink included, is never written through; files
written by name by a library go into a private directory this process has just created.

Reading a file from a place others can write: opened without following a final symlink and
without blocking (a FIFO would wedge the reader), checked to be a regular file, and read up to a
size bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


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
        # at a job's run, a path checked at submission that leads out now was changed since
        raise OutsideRoots(f"{what} {label!r} resolves outside the allowed roots (symlinks followed)")
    return real


class UnsafeFile(OSError):
    """A file that is not a plain regular file of a bounded size where one was to be read."""


def read_regular(name: str | Path, limit: int, what: str, dir_fd: int | None = None) -> bytes:
    """The bytes of `name` (relative to `dir_fd` when given), which must be a regular file of at
    most `limit` bytes: a symlink, a FIFO, a device or a directory is refused, never followed or
    waited on. UnsafeFile names `what` (how the caller calls the file)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise UnsafeFile(f"{what} is a symlink; refusing to follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{what} is not a regular file")
        if st.st_size > limit:
            raise UnsafeFile(f"{what} is {st.st_size} bytes, more than the {limit} this file may hold")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafeFile(f"{what} grew past the {limit} bytes this file may hold while it was read")
        return data
    finally:
        os.close(fd)


def open_regular(path: str | Path, what: str) -> BinaryIO:
    """`path` opened for reading without blocking on it (a FIFO would wait for a writer for good),
    which must be a regular file: a FIFO, a device or a directory is UnsafeFile naming `what`."""
    fd = os.open(path, _READ_FLAGS & ~_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(f"{what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def made_by_us(dir_fd: int) -> bool:
    """Whether the directory is owned as a file this process creates in it is (its uid, or the
    one the file system gives it, such as NFS's squashed root): not another user's, who could
    have put anything in it."""
    try:
        probe = os.open(".owner-probe", _CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:  # a directory just made holds nothing
        return False
    try:
        ours = os.fstat(probe).st_uid
    finally:
        os.close(probe)
        os.unlink(".owner-probe", dir_fd=dir_fd)
    return os.fstat(dir_fd).st_uid == ours


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

    def create(self, name: str, mode: int = 0o644) -> int:
        """A descriptor of a file this call creates as `name` (write-only); FileExistsError when
        anything, a symlink included, already has that name."""
        return os.open(name, _CREATE_FLAGS, mode, dir_fd=self.fd)

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of the regular file `name` in this directory (read_regular)."""
        return read_regular(name, limit, f"{self.what} file {name!r}", dir_fd=self.fd)

    def mkdir_fresh(self, prefix: str, mode: int = 0o700) -> tuple[str, ConfinedDir]:
        """A directory this call creates under a new name starting with `prefix` (its name and
        the directory): no one else can have put anything in it."""
        while True:
            name = f"{prefix}{uuid.uuid4().hex[:12]}"
            with contextlib.suppress(FileExistsError):
                return name, self.mkdir_private(name, mode)

    def mkdir_private(self, name: str, mode: int = 0o700) -> ConfinedDir:
        """The directory `name`, which this call creates (FileExistsError when the name is taken)."""
        os.mkdir(name, mode, dir_fd=self.fd)
        child = object.__new__(ConfinedDir)
        child.path, child.what = self.path / name, self.what
        child.fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=self.fd)
        # in a directory others can write, the new one may have been swapped between mkdir and
        # open: what was opened must be one this process made
        if not made_by_us(child.fd):
            child.close()
            raise OutsideRoots(f"{self.what} {str(child.path)!r} was replaced while it was being created")
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
