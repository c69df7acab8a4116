"""Versioned publishing of a continual job's drafter, for a serving engine to load.

Layout of `publish_dir`:
  v000001/, v000002/, ...  each a complete export (config.json, modeling file, model.safetensors,
                           dflash_metadata.json); config.json states the block layout
                           (`sample_from_anchor`) and, under `dflash_target`, the target identity
  latest                   a symlink to the newest version, replaced by a rename
  versions.json            [{version, step, tau, target, time, path}], oldest first

A version is written under a hidden staging name (itself written atomically by the checkpoint
writer), completed with its target identity, fsync'd, and only then renamed to its version name;
`latest` and versions.json move after it, each by a rename. A kill at any moment therefore leaves
the previous version and pointer intact, plus at most a hidden staging directory, which the next
run removes. Every operation goes through the directory's descriptor (confine.ConfinedDir).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CONFIG_FILE, write_checkpoint
from ..config import DrafterConfig
from ..confine import ConfinedDir

log = logging.getLogger("dflash.continual")
VERSIONS_FILE = "versions.json"
LATEST = "latest"
_STAGING = ".staging-"
RELOAD_TIMEOUT_SECONDS = 10.0


def version_name(version: int) -> str:
    return f"v{version:06d}"


class Publisher:
    def __init__(self, publish_dir: str, roots: list[str], keep_versions: int, target: dict[str, Any]):
        self.dir = ConfinedDir(publish_dir, roots, "publish_dir")
        self.keep = max(1, keep_versions)
        self.target = target
        for entry in list(self.dir.entries()):  # what a killed publish left
            if entry.name.startswith((_STAGING, ".tmp-", ".old-", ".latest-", ".versions-")):
                self.dir.remove_tree(entry.name)
        self.versions: list[dict[str, Any]] = [v for v in self._read_versions() if self.dir.exists(v["name"])]

    def close(self) -> None:
        self.dir.close()

    def _read_versions(self) -> list[dict[str, Any]]:
        if not self.dir.exists(VERSIONS_FILE):
            return []
        try:
            listed = json.loads(Path(self.dir.at(VERSIONS_FILE)).read_text())
        except (OSError, ValueError):
            return []
        return [v for v in listed if isinstance(v, dict) and isinstance(v.get("version"), int)]

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.versions[-1] if self.versions else None

    def path_of(self, entry: dict[str, Any]) -> Path:
        return self.dir.path / entry["name"]

    def publish(
        self, config: DrafterConfig, weights: dict[str, torch.Tensor], *, step: int, tau: float, export_dtype: str
    ) -> dict[str, Any]:
        """Write the next version and point `latest` at it; its versions.json entry."""
        version = (self.versions[-1]["version"] if self.versions else 0) + 1
        name = version_name(version)
        staging = _STAGING + name
        entry = {
            "version": version,
            "name": name,
            "path": str(self.dir.path / name),
            "step": step,
            "tau": tau,
            "target": self.target,
            "time": time.time(),
        }
        meta = {"step": step, "published_version": version, "acceptance_length": tau, "target": self.target}
        write_checkpoint(
            self.dir.path / staging, config, weights, metadata=meta, parent=self.dir, export_dtype=export_dtype
        )
        self._state_target(staging)
        self.dir.rename(staging, name)
        self.dir.fsync()
        self._point_latest(name)
        self.versions.append(entry)
        dropped, self.versions = self.versions[: -self.keep], self.versions[-self.keep :]
        self._write_versions()  # before the old directories go: the list never names a missing one
        for old in dropped:
            if self.dir.exists(old["name"]):
                self.dir.remove_tree(old["name"])
        return entry

    def _state_target(self, staging: str) -> None:
        """config.json of the staged version gains the target identity (what a server checks the
        drafter against), written beside it and renamed over it."""
        config_path = Path(self.dir.at(f"{staging}/{CONFIG_FILE}"))
        config = json.loads(config_path.read_text())
        config["dflash_target"] = self.target
        tmp = Path(self.dir.at(f"{staging}/.{CONFIG_FILE}.tmp"))
        with tmp.open("w") as f:
            f.write(json.dumps(config, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, config_path)
        fd = os.open(self.dir.at(staging), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _point_latest(self, name: str) -> None:
        tmp = f".latest-{os.getpid()}"
        if self.dir.exists(tmp):
            self.dir.remove_tree(tmp)
        os.symlink(name, tmp, dir_fd=self.dir.fd)
        self.dir.rename(tmp, LATEST)
        self.dir.fsync()

    def _write_versions(self) -> None:
        tmp = f".versions-{os.getpid()}.json"
        with open(self.dir.at(tmp), "w") as f:
            f.write(json.dumps(self.versions, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(self.dir.at(tmp), 0o644)
        self.dir.rename(tmp, VERSIONS_FILE)
        self.dir.fsync()


def notify_reload(url: str, entry: dict[str, Any]) -> dict[str, Any]:
    """POST the published version to a serving engine's reload hook; what it answered (or why
    not), for the publish event. Never raises: a serving engine that is down must not stop the job."""
    body = json.dumps(
        {"model_path": entry["path"], "version": entry["version"], "tau": entry["tau"], "step": entry["step"]}
    ).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=RELOAD_TIMEOUT_SECONDS) as response:
            return {"url": url, "status": response.status}
    except urllib.error.HTTPError as e:
        return {"url": url, "status": e.code, "error": str(e.reason)}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"url": url, "error": f"{type(e).__name__}: {getattr(e, 'reason', e)}"}
