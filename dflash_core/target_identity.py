"""What an exported drafter records about its target, and the dtype its weights are exported in.

A checkpoint travels: it is copied to a serving host, a bucket, a model hub. So it records the
target by what identifies it anywhere (its hub id where the directory is a hub snapshot, and a
hash of its config.json) and never by a path of the training host. `export_dtype: "auto"`
exports in the dtype the target declares (bf16 for a bf16 target: what a runtime serving that
target loads the drafter in); the fp32 master weights stay in training_state/ for resume."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

EXPORT_DTYPE_CHOICES = ("auto", "fp32", "bf16")
_DECLARED = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# the Hugging Face cache's layout of a downloaded repository: .../models--ORG--NAME/snapshots/REV
_HUB_CACHE = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9_.-]*)--([A-Za-z0-9][A-Za-z0-9_.-]*)$")


def _config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def hub_id(path: str | Path, config: dict[str, Any] | None = None) -> str | None:
    """The target's hub id where it is known: the snapshot directory of a Hugging Face cache, or a
    `_name_or_path` in its config.json that is a hub id (ORG/NAME, not a filesystem path)."""
    for part in reversed(Path(path).resolve().parts):
        m = _HUB_CACHE.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    name = (config if config is not None else _config(path)).get("_name_or_path")
    if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).exists():
        return name
    return None


def config_sha256(config: dict[str, Any]) -> str:
    """A hash of the target's config (canonical JSON, without transformers' bookkeeping keys that
    start with an underscore or name the transformers version)."""
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def declared_dtype(config: dict[str, Any]) -> str | None:
    """The dtype the target's config.json declares ("dtype", or "torch_dtype" before
    transformers 5), as an export dtype name; None when it declares none we export in."""
    name = config.get("dtype") or config.get("torch_dtype")
    return _DECLARED.get(str(name)) if name else None


def target_identity(path: str | Path) -> dict[str, Any]:
    """{"name": hub id or None, "config_sha256": ..., "dtype": declared export dtype or None}."""
    config = _config(path)
    return {"name": hub_id(path, config), "config_sha256": config_sha256(config), "dtype": declared_dtype(config)}


def resolve_export_dtype(export_dtype: str, target_dtype: str | None) -> str:
    """ "auto" -> the target's declared dtype (fp32 where it declares none); others as given."""
    if export_dtype not in EXPORT_DTYPE_CHOICES:
        raise ValueError(f"export_dtype must be one of {list(EXPORT_DTYPE_CHOICES)}, got {export_dtype!r}")
    if export_dtype != "auto":
        return export_dtype
    return target_dtype or "fp32"
