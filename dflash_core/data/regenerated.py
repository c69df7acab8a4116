"""The output of a regeneration job read as a dataset: a directory with a manifest that lists its
complete parquet shards (the shards a run wrote to the end; a shard being written is a hidden
temporary file the manifest does not name). A training job that names such a directory reads
exactly the shards of its manifest, in order. Others may write where the output lies, so its
manifest is read as a bounded regular file, never through a symlink (confine.read_regular)."""

from __future__ import annotations

import json
from pathlib import Path

from ..confine import read_regular
from .errors import DatasetError
from .source_file import SourceFile, child_name

MANIFEST = "regeneration.json"
FORMAT = "dflash-regeneration"
# about 100 bytes a shard: over 600,000 shards (hundreds of millions of rows at the default
# shard_rows); a planted file larger is refused unread, and one within it costs the reader
# little memory even as pathological JSON. The writer refuses to write a manifest past it.
MANIFEST_LIMIT = 64 << 20


def read_manifest(directory: Path, label: str | None = None) -> dict:
    label = str(directory) if label is None else label
    try:
        data = read_regular(directory / MANIFEST, MANIFEST_LIMIT, f"{label}/{MANIFEST}")
        manifest = json.loads(data.decode("utf-8"))
    except OSError as e:
        raise DatasetError(
            f"{label}/{MANIFEST}", 0, f"not a readable regeneration manifest ({e.strerror or e})"
        ) from None
    except ValueError as e:
        raise DatasetError(f"{label}/{MANIFEST}", 0, f"not a readable regeneration manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{label}/{MANIFEST}", 0, f"not a regeneration manifest (format != {FORMAT!r})")
    return manifest


def regenerated_sources(directory: Path, label: str) -> list[SourceFile]:
    """The SourceFiles of a regeneration output directory's complete shards."""
    manifest = read_manifest(directory, label)
    shards = sorted(manifest.get("shards") or [], key=lambda s: int(s["index"]))
    if not shards:
        raise DatasetError(label, 0, "the regeneration has written no complete shard yet")
    for s in shards:  # the manifest names shards beside it, never a path elsewhere
        name = s.get("file")
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise DatasetError(f"{label}/{MANIFEST}", 0, f"shard file {name!r} is not a file name in this directory")
    return [SourceFile(directory / s["file"], "parquet", child_name(label, s["file"])) for s in shards]
