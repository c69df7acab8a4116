"""A tokenization cache entry is trusted only once verified: written durably with a manifest,
checked against it whenever it is opened, set aside and rebuilt when it does not match.

- durable: every array file and meta.json are fsynced before the entry's directory is renamed into
  place, and the cache directory after it, so a crash leaves a complete entry or none;
- manifest (in meta.json): each array's size and a digest of its bytes, all of them for files up
  to FULL_HASH_BYTES, else evenly spaced sample blocks (the same digest identifies a dataset file's
  content for the cache key: an in-place edit that keeps size and mtime is still noticed);
- checked on open: meta.json parses, the array sizes agree with the manifest and with the counts
  (tokens, documents), the lengths add up to the tokens, the digests match. A bad entry is named,
  moved to `<cache>/quarantine/` and rebuilt; the newest QUARANTINE_KEEP are kept for a look, none
  longer than QUARANTINE_SECONDS (a copy is as large as the entry: they must not pile up);
- partial entries (`.tmp-*`) whose writer process is gone are swept before a corpus is prepared.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("dflash.data")

# array file -> bytes per element
ARRAYS = {"tokens.i32": 4, "mask.u8": 1, "lengths.i64": 8, "positions.i64": 8}
# Files up to FULL_HASH_BYTES are hashed whole; larger ones by SAMPLE_BLOCKS blocks spread from head
# to tail. Every job start digests every dataset file and every entry's arrays this way, so the cost
# per file must stay a few milliseconds whatever the corpus size (a whole-file hash would read the
# corpus at every start); a change outside the sampled blocks of a large file goes unnoticed.
FULL_HASH_BYTES = 1 << 20
SAMPLE_BLOCK = 64 << 10
SAMPLE_BLOCKS = 16
QUARANTINE_KEEP = 8
QUARANTINE_SECONDS = 7 * 24 * 3600
MAX_META_BYTES = 1 << 20  # meta.json holds counts and at most a few error messages


class BadEntry(Exception):
    """A cache entry that does not match its manifest; the message says how."""


# what an OSError says about this process, not about the file it was opening: never a reason to
# take an entry for corrupt (EMFILE, ENFILE: open files; ENOMEM: memory or memory maps)
PROCESS_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def process_limit(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in PROCESS_LIMITS


def file_digest(path: str | Path) -> str:
    """A digest of the file's size and content: all of it up to FULL_HASH_BYTES, else SAMPLE_BLOCKS
    blocks spread from its head to its tail."""
    from ..confine import open_regular

    h = hashlib.blake2b(digest_size=16)
    with open_regular(path, str(path)) as f:  # a dataset file may have become a FIFO: never wait on it
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        if size <= FULL_HASH_BYTES:
            while block := f.read(1 << 20):
                h.update(block)
        else:
            for i in range(SAMPLE_BLOCKS):
                h.update(os.pread(f.fileno(), SAMPLE_BLOCK, (size - SAMPLE_BLOCK) * i // (SAMPLE_BLOCKS - 1)))
    return h.hexdigest()


def sync_files(*files: Any) -> None:
    for f in files:
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """meta.json with the manifest of the arrays already written (and synced) in `directory`."""
    meta = {
        **meta,
        "manifest": {
            name: {"bytes": (directory / name).stat().st_size, "digest": file_digest(directory / name)}
            for name in ARRAYS
        },
    }
    with (directory / "meta.json").open("w") as f:
        f.write(json.dumps(meta, indent=1))
        sync_files(f)


def verified_meta(directory: Path) -> dict[str, Any]:
    """The entry's meta.json once the entry matches it; raises BadEntry."""
    try:
        with (directory / "meta.json").open("rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except FileNotFoundError:
        raise BadEntry("meta.json is missing") from None
    except OSError as e:
        if process_limit(e):
            raise
        raise BadEntry(f"meta.json cannot be read ({e.strerror or e})") from None
    if len(raw) > MAX_META_BYTES:
        raise BadEntry("meta.json is larger than an entry's metadata can be")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadEntry("meta.json is not valid JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("manifest"), dict):
        raise BadEntry("meta.json holds no manifest")
    try:
        tokens, documents = int(meta["tokens"]), int(meta["documents"])
        for key in ("records", "bad_records", "truncated"):
            int(meta[key])
        if not isinstance(meta["errors"], list):
            raise TypeError
        expected = {"tokens.i32": tokens, "mask.u8": tokens, "lengths.i64": documents, "positions.i64": documents}
        for name, count in expected.items():
            entry = meta["manifest"][name]
            _check_array(directory / name, count * ARRAYS[name], int(entry["bytes"]), str(entry["digest"]))
    except (KeyError, TypeError, ValueError):
        raise BadEntry("meta.json lacks a count or a manifest field") from None
    lengths = np.fromfile(directory / "lengths.i64", dtype=np.int64)
    if (lengths < 0).any() or int(lengths.sum()) != tokens:
        raise BadEntry("the document lengths do not add up to the tokens")
    return meta


def _check_array(path: Path, expected_bytes: int, manifest_bytes: int, digest: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise BadEntry(f"{path.name} is missing") from None
    if size != manifest_bytes or size != expected_bytes:
        raise BadEntry(
            f"{path.name} holds {size} bytes, the manifest says {manifest_bytes} ({expected_bytes} by count)"
        )
    if file_digest(path) != digest:
        raise BadEntry(f"{path.name} does not match its digest (its content changed after it was written)")


def quarantine(directory: Path, reason: str, dataset: str) -> Path | None:
    """Move a bad entry out of the cache (where nothing reads it), keeping the newest few; where it went."""
    place = directory.parent / "quarantine"
    target = place / f"{directory.name}-{time.time_ns()}"
    try:
        place.mkdir(exist_ok=True)
        os.rename(directory, target)
    except OSError as e:
        log.warning("could not quarantine a bad cache entry; removing it", extra={"fields": {"error": str(e)}})
        shutil.rmtree(directory, ignore_errors=True)
        target = None  # type: ignore[assignment]
    log.warning(
        "tokenized cache entry is corrupt: quarantined, the dataset is tokenized again",
        extra={"fields": {"dataset": dataset, "entry": directory.name, "reason": reason, "moved_to": str(target)}},
    )
    prune_quarantine(directory.parent)
    return target


def _quarantined_at(path: Path) -> float:
    """When a copy was set aside (seconds): the time its name ends with, else its mtime."""
    stamp = path.name.rsplit("-", 1)[-1]
    return int(stamp) / 1e9 if stamp.isdigit() else path.stat().st_mtime


def prune_quarantine(cache_root: Path, now: float | None = None) -> list[str]:
    """Remove the quarantined copies beyond the newest QUARANTINE_KEEP and those set aside more
    than QUARANTINE_SECONDS ago; the names removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    with contextlib.suppress(OSError):
        copies = sorted((p for p in (cache_root / "quarantine").iterdir()), key=_quarantined_at, reverse=True)
        for i, p in enumerate(copies):
            if i >= QUARANTINE_KEEP or now - _quarantined_at(p) > QUARANTINE_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def temp_name(final: str) -> str:
    """The name a partial entry is written under: its writer's pid tells the sweep whether it is alive."""
    return f".tmp-{final}-{os.getpid()}-{os.urandom(4).hex()}"


def sweep_partial(directory: Path) -> list[str]:
    """Remove `.tmp-*` entries in `directory` whose writer process is gone (a killed daemon's);
    the names removed. A writer on another host sharing the directory is not told apart from a
    dead one of this host only when their pids collide; such a writer fails its rename and retries."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    except OSError:
        return removed
    for name in names:
        pid = _writer_pid(name)
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue
        shutil.rmtree(directory / name, ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("removed partial cache entries", extra={"fields": {"directory": str(directory), "names": removed}})
    return removed


def _writer_pid(name: str) -> int | None:
    parts = name.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
