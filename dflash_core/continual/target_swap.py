"""A moving target: new versions of the target that appear in a watched directory (an RL
trainer's saved policy) are loaded in place into the parameter storage the engine already holds,
so the target's recorded graphs and the drafters' frozen heads stay valid and nothing compiles.

A version is a subdirectory with a config.json and its weights as `*.safetensors` (a name
starting with a dot is a writer's temporary directory), taken once its files held still over one
poll. It is loaded only if it is the same architecture with the same tensors: every tensor of the
engine's target present with the same shape, nothing unknown, and the architecture fields of its
config equal; anything else is refused with the reason, and the job goes on with the target it
has. The check reads only the files' headers; the copy happens after it passed, between steps,
with the feature pipeline stopped.

Targets held in FP8 (a stored FP8 checkpoint, or `target_precision = "fp8"`) keep quantized
copies beside their parameters and are not swapped here: such a job is refused at admission.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ..confine import OutsideRoots, resolved_under
from ..engine.api import JobError
from ..engine.context import RunContext
from ..target import TargetModel
from .job import ContinualJob

# the config fields that decide the tensors' meaning, beyond their shapes
ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


class SwapRefused(ValueError):
    """A target version this engine cannot load in place; the message says why."""


def swappable(target: TargetModel) -> str | None:
    """Why this target cannot take versions in place (None: it can)."""
    if target.stored_fp8 or getattr(target, "_input_casts", None) is not None:
        return "the target runs in FP8 (quantized copies beside its weights); its versions are not swapped in place"
    return None


class TargetWatch:
    def __init__(self, directory: str, roots: list[str], loaded: str | None = None):
        self.directory = Path(directory)
        self.roots = roots
        self.loaded = loaded  # the version name loaded last (or refused: not tried again)
        self._seen: dict[str, tuple] = {}

    def newest(self) -> Path | None:
        """The newest version (by name) that held still over a poll and is not the one loaded."""
        try:
            versions = sorted(
                p
                for p in self.directory.iterdir()
                if p.is_dir() and not p.name.startswith(".") and (p / "config.json").is_file()
            )
        except OSError:
            return None
        for path in reversed(versions):
            if path.name == self.loaded:
                return None
            signature = _signature(path)
            stable = signature and self._seen.get(path.name) == signature
            self._seen[path.name] = signature
            if stable:
                return path
            return None  # the newest is still being written: wait for it
        return None


def _signature(path: Path) -> tuple:
    try:
        return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file()))
    except OSError:
        return ()


def _weight_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and not p.name.startswith("."))
    if not files:
        raise SwapRefused("no *.safetensors weights in the version")
    return files


def check_version(target: TargetModel, path: Path, roots: list[str]) -> dict[str, tuple[Path, str]]:
    """Where each tensor of the target is in the version ({name: (file, key)}); SwapRefused with
    the reason when the version is not the same architecture and tensors."""
    from safetensors import safe_open

    try:
        real = resolved_under(path, roots, "target version", path.name)
        config = json.loads((real / "config.json").read_text())
    except (OSError, ValueError, OutsideRoots) as e:
        raise SwapRefused(f"its config.json cannot be read ({type(e).__name__}: {e})") from None
    mine = target.config.to_dict()
    differ = [k for k in ARCHITECTURE_FIELDS if k in config and k in mine and config[k] != mine[k]]
    if differ:
        raise SwapRefused(f"another architecture: {', '.join(f'{k} {config[k]!r} (now {mine[k]!r})' for k in differ)}")
    state = target.model.state_dict()
    where: dict[str, tuple[Path, str]] = {}
    for file in _weight_files(real):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                if key not in state:
                    raise SwapRefused(f"a tensor this target does not have: {key}")
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(state[key].shape):
                    raise SwapRefused(f"{key} has shape {list(shape)}, the target's is {list(state[key].shape)}")
                where[key] = (file, key)
    tied = {k for k in state if k not in where and _tied(target, k)}
    missing = sorted(set(state) - set(where) - tied)
    if missing:
        raise SwapRefused(
            f"tensors missing from the version: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        )
    return where


def _tied(target: TargetModel, name: str) -> bool:
    """The LM head of a target whose head shares the embedding's storage (stored once)."""
    head = target.model.get_output_embeddings()
    return (
        head is not None
        and name.endswith("lm_head.weight")
        and head.weight is target.model.get_input_embeddings().weight
    )


@torch.no_grad()
def load_in_place(targets: list[TargetModel], where: dict[str, tuple[Path, str]]) -> int:
    """Copy the version's tensors into every target copy's own storage; the bytes copied."""
    from safetensors import safe_open

    states = [t.model.state_dict() for t in targets]
    copied = 0
    by_file: dict[Path, list[str]] = {}
    for name, (file, _) in where.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                tensor = f.get_tensor(where[name][1])
                for state in states:
                    state[name].copy_(tensor)
                copied += tensor.numel() * tensor.element_size()
    return copied


@torch.no_grad()
def refresh_heads(target: TargetModel, heads: list[Any]) -> None:
    """The drafters' frozen embedding and LM head, copied again from the target in place."""
    fresh = target.frozen_head()
    for head in heads:
        if head.embed_weight.data_ptr() != fresh.embed_weight.data_ptr():
            head.embed_weight.copy_(fresh.embed_weight)
        if head.lm_head_weight.data_ptr() != fresh.lm_head_weight.data_ptr():
            head.lm_head_weight.copy_(fresh.lm_head_weight)


class TargetSwapper:
    """Loads the versions a TargetWatch finds into the engine's target copies and the drafters'
    frozen heads."""

    def __init__(self, watch: TargetWatch, targets: list[TargetModel], heads: list[Any], roots: list[str]):
        self.watch, self.targets, self.heads, self.roots = watch, targets, heads, roots

    def swap(self, path: Path) -> dict[str, Any]:
        """Load `path` in place (the caller has stopped everything that reads the target); its
        `target_swap` event. SwapRefused leaves the target as it was (nothing is copied before
        every tensor was checked)."""
        self.watch.loaded = path.name  # a refused version is not tried again
        where = check_version(self.targets[0], path, self.roots)
        began = time.monotonic()
        copied = load_in_place(self.targets, where)
        refresh_heads(self.targets[0], self.heads)
        for target in self.targets:
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
        return {
            "version": path.name,
            "seconds": round(time.monotonic() - began, 4),
            "bytes": copied,
            "tensors": len(where),
        }


def check_target_watch(context: RunContext, job: ContinualJob) -> None:
    """JobError naming `target_watch` when this engine cannot take the job's target versions."""
    assert job.target_watch is not None
    try:
        if not resolved_under(job.target_watch, job.dataset_roots, "target_watch").is_dir():
            raise JobError("not a directory (new target versions appear in it as subdirectories)", "target_watch")
    except OutsideRoots as e:
        raise JobError(str(e), "target_watch") from None
    if context.config.target_random_init:
        raise JobError("the engine's target has random weights: it could not be restored after a swap", "target_watch")
    if context.parts is not None:
        why = swappable(context.parts.targets[0])
        if why is None and any(r.head.lm_head_fp8 is not None for r in context.parts.replicas):
            why = "the drafters' loss runs on an FP8 copy of the LM head; it is not swapped in place"
        if why is not None:
            raise JobError(why, "target_watch")
