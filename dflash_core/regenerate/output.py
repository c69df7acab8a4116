"""A regeneration's output directory: parquet shards of conversations plus the manifest that
lists the complete ones (dflash_core.data.regenerated reads it back).

Only complete shards are visible: a shard is written to a hidden temporary file, flushed to disk,
renamed to its name, and only then added to the manifest, itself replaced by a rename. A run
killed at any point leaves the manifest of the shards written to the end; the next run skips
exactly those and writes the others again, so no row is lost and none written twice. Everything
goes through the directory's descriptor (confine.ConfinedDir): a component swapped for a symlink
after submission cannot redirect a write. Temporary files are created fresh (never opened by a
name someone else may have planted) inside a private staging directory this run creates, then
renamed into the output directory; the manifest is read back as a bounded regular file.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, BinaryIO

from ..confine import ConfinedDir, OutsideRoots
from ..data.regenerated import FORMAT, MANIFEST, MANIFEST_LIMIT
from ..engine.api import JobError

TEMP_PREFIX = ".tmp-"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def _schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("messages", pa.list_(message)),
            ("source", pa.string()),
            ("sample", pa.int32()),
            ("prompt_tokens", pa.int32()),
            ("completion_tokens", pa.int32()),
            ("finish_reason", pa.string()),
        ]
    )


class ShardOutput:
    def __init__(self, output_dir: str, roots: list[str]):
        try:
            self.dir = ConfinedDir(output_dir, roots, "output_dir")
        except OutsideRoots as e:
            raise JobError(str(e), "output_dir") from None
        except OSError as e:
            raise JobError(f"output_dir {output_dir!r} cannot be written: {e.strerror or e}", "output_dir") from None
        self.output_dir = output_dir
        for entry in self.dir.entries():  # what a killed run was writing
            if entry.name.startswith(TEMP_PREFIX):
                self.dir.remove_tree(entry.name)
        self.manifest: dict[str, Any] = {}
        self._staging_name, self._staging = self.dir.mkdir_fresh(f"{TEMP_PREFIX}staging-")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._staging.close()
            if self.dir.exists(self._staging_name):
                self.dir.remove_tree(self._staging_name)
        self.dir.close()

    def start(self, plan: dict[str, Any]) -> dict[str, Any]:
        """The manifest to continue: the existing one when it was written for the same plan (a
        resume), a new one when there is none or it lists no shard; a JobError when the directory
        holds another regeneration's output."""
        if self.dir.exists(MANIFEST):
            try:
                existing = json.loads(self.dir.read(MANIFEST, MANIFEST_LIMIT).decode("utf-8"))
            except (OSError, ValueError) as e:
                raise JobError(
                    f"output_dir {self.output_dir!r}: {MANIFEST} cannot be read as a regeneration manifest "
                    f"({e}); choose another output_dir",
                    "output_dir",
                ) from None
            ours = isinstance(existing, dict) and existing.get("format") == FORMAT
            if ours and not existing.get("shards"):  # a run that wrote nothing: nothing to keep or continue
                existing = None
            elif not ours or existing.get("plan") != plan:
                plan_then = existing.get("plan") if isinstance(existing, dict) else None
                plan_then = plan_then if isinstance(plan_then, dict) else {}
                differ = sorted(k for k in plan if plan_then.get(k) != plan[k])
                raise JobError(
                    f"output_dir {self.output_dir!r} holds another regeneration's output (it differs in "
                    f"{', '.join(differ) or 'its format'}); choose another output_dir",
                    "output_dir",
                )
            self.manifest = existing or {}
        if not self.manifest:
            self.manifest = {
                "format": FORMAT,
                "version": 1,
                "complete": False,
                "plan": plan,
                "shards": [],
                "counts": {"rows": 0, "tokens_generated": 0, "finish_reasons": {}},
            }
            self._write_manifest()
        return self.manifest

    def done_shards(self) -> set[int]:
        return {int(s["index"]) for s in self.manifest.get("shards", [])}

    def write_shard(self, index: int, rows: list[dict[str, Any]]) -> str:
        """Write one complete shard and list it in the manifest; its path."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = shard_name(index)
        tmp = f"{TEMP_PREFIX}{name}"
        table = pa.Table.from_pylist(rows, schema=_schema())
        need = 2 * table.nbytes + (1 << 20)
        free = self.dir.free_bytes()
        if free < need:  # refuse before writing rather than fail mid-file
            raise JobError(
                f"shard {name} not written: {free / 2**20:.1f} MiB free on the output_dir's file system, it needs "
                f"about {need / 2**20:.1f} MiB (ENOSPC); the complete shards stay and the job resumes from them"
            )
        try:
            with self._fresh(tmp) as f:
                pq.write_table(table, f, compression="zstd")
            self._publish(tmp, name)
            tokens = sum(int(r["completion_tokens"]) for r in rows)
            self.manifest["shards"].append(
                {"index": index, "file": name, "rows": len(rows), "tokens_generated": tokens}
            )
            self.manifest["shards"].sort(key=lambda s: s["index"])
            counts = self.manifest["counts"]
            counts["rows"] += len(rows)
            counts["tokens_generated"] += tokens
            reasons = counts["finish_reasons"]
            for r in rows:
                reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
            self._write_manifest()
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._staging.fd)
            raise JobError(
                f"shard {name} not written: {e.strerror or e}; the complete shards stay and the job resumes from them"
            ) from None
        return str(self.dir.path / name)

    def finish(self) -> None:
        self.manifest["complete"] = True
        self._write_manifest()

    def _fresh(self, name: str) -> BinaryIO:
        """A file created now in the staging directory, written through its descriptor."""
        return os.fdopen(self._staging.create(name), "wb")

    def _publish(self, tmp: str, name: str) -> None:
        """The staged file `tmp`, flushed to disk, renamed to `name` in the output directory."""
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._staging.fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=self._staging.fd, dst_dir_fd=self.dir.fd)
        self.dir.fsync()

    def _write_manifest(self) -> None:
        data = json.dumps(self.manifest, indent=1, sort_keys=True).encode("utf-8")
        if len(data) > MANIFEST_LIMIT:  # an output no reader would take: refused before it is written
            raise JobError(
                f"{MANIFEST} would hold {len(self.manifest['shards'])} shards, more than a reader takes "
                f"({MANIFEST_LIMIT >> 20} MiB); the complete shards stay: regenerate the rest into another "
                "output_dir, or with more rows per shard"
            )
        tmp = f"{TEMP_PREFIX}{MANIFEST}"
        with self._fresh(tmp) as f:
            f.write(data)
        self._publish(tmp, MANIFEST)
