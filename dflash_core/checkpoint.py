"""Drafter checkpoints in the format the z-lab `DFlashDraftModel`, SGLang and vLLM load:
a directory with `config.json` (Qwen3 config + DFlash fields) and `model.safetensors` (drafter
weights only: no embedding, no LM head), plus our training state beside them for resume.
Every checkpoint is written into a temporary directory and renamed into place, so a crash never
leaves a torn checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import DrafterConfig
from .confine import ConfinedDir
from .drafter import DFlashDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
METADATA_FILE = "dflash_metadata.json"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def expected_keys(num_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        keys |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


def hf_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The checkpoint's config.json. RoPE is written in both spellings transformers has used:
    `rope_theta` + `rope_scaling` (null for default RoPE; what transformers 4.x and the runtimes
    built on it read) and `rope_parameters` (transformers 5). Both say the same, so a Qwen3Config
    loaded from the file by either gives the drafter's rotary embedding. LongRoPE's pretraining
    length also goes at the top level, where transformers 4.x reads it (Phi-3's layout)."""
    scaling = cfg.rope_scaling or {}
    longrope = {}
    if cfg.rope_type == "longrope" and "original_max_position_embeddings" in scaling:
        longrope = {"original_max_position_embeddings": scaling["original_max_position_embeddings"]}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": cfg.rope_parameters,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        **longrope,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def config_from_hf(d: dict[str, Any]) -> DrafterConfig:
    dflash = d.get("dflash_config") or {}
    # rope_parameters where present (transformers 5); else the legacy keys, as checkpoints
    # written before it carry them (a rope_scaling of default RoPE reads as none)
    rope_theta, rope_scaling = d.get("rope_theta", 1_000_000.0), d.get("rope_scaling")
    if isinstance(d.get("rope_parameters"), dict) and d["rope_parameters"]:
        rope_scaling = dict(d["rope_parameters"])
        rope_theta = rope_scaling.pop("rope_theta", rope_theta)
    return DrafterConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        vocab_size=d["vocab_size"],
        block_size=d["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        num_target_layers=d["num_target_layers"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=d.get("max_position_embeddings", 40960),
    )


def cpu_copy(obj: Any) -> Any:
    """A copy of a (nested) state on the CPU that later in-place updates cannot reach: CPU
    tensors are cloned too, since `.to("cpu")` would return them as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def save_checkpoint(
    path: str | Path,
    drafter: DFlashDrafter,
    *,
    training_state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    weights = {k: v.detach().to("cpu") for k, v in drafter.state_dict().items()}
    return write_checkpoint(path, drafter.config, weights, training_state=training_state, metadata=metadata)


def write_checkpoint(
    path: str | Path,
    config: DrafterConfig,
    weights: dict[str, torch.Tensor],
    *,
    training_state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    parent: ConfinedDir | None = None,
) -> Path:
    """Write CPU weights (and state) as a checkpoint directory, atomically (temp dir + rename).
    With `parent` (the directory `path` is in, held open by ConfinedDir), every step goes through
    its descriptor: a path component swapped for a symlink cannot redirect the write."""
    final = Path(path)
    missing = expected_keys(config.num_hidden_layers) ^ set(weights)
    if missing:
        raise RuntimeError(f"drafter state keys differ from the checkpoint format: {sorted(missing)}")
    if parent is None:
        parent = ConfinedDir(final.parent, [], "checkpoint directory")
        own_parent = True
    else:
        own_parent = False
    tmp_name = f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp = parent.mkdir_private(tmp_name)
        try:
            with tmp:
                save_file(
                    {k: v.contiguous() for k, v in weights.items()}, tmp.at(WEIGHTS_FILE), metadata={"format": "pt"}
                )
                dt = next(iter(weights.values())).dtype
                Path(tmp.at(CONFIG_FILE)).write_text(json.dumps(hf_config(config, dt), indent=2) + "\n")
                if metadata is not None:
                    Path(tmp.at(METADATA_FILE)).write_text(json.dumps(metadata, indent=2, default=str) + "\n")
                if training_state is not None:
                    torch.save(training_state, tmp.at(TRAINING_STATE_FILE))
                for entry in tmp.entries():
                    fd = os.open(entry.name, os.O_RDONLY, dir_fd=tmp.fd)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                tmp.fsync()
            if parent.exists(final.name):
                old = f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                parent.rename(final.name, old)
                parent.rename(tmp_name, final.name)
                parent.remove_tree(old)
            else:
                parent.rename(tmp_name, final.name)
            parent.fsync()
        except BaseException:
            if parent.exists(tmp_name):
                parent.remove_tree(tmp_name)
            raise
    finally:
        if own_parent:
            parent.close()
    return final


def read_config(path: str | Path) -> DrafterConfig:
    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p}: not a drafter checkpoint (no {CONFIG_FILE})")
    return config_from_hf(json.loads(p.read_text()))


def load_weights(path: str | Path, num_layers: int) -> dict[str, torch.Tensor]:
    state = load_file(str(Path(path) / WEIGHTS_FILE))
    diff = expected_keys(num_layers) ^ set(state)
    if diff:
        raise ValueError(f"{path}: checkpoint keys differ from the DFlash format: {sorted(diff)[:8]}")
    return state


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    cfg = read_config(path)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(load_weights(path, cfg.num_hidden_layers))
    return drafter.to(device=device, dtype=dtype) if dtype else drafter.to(device)


class UnsafeTrainingState(ValueError):
    """A training state file that holds more than tensors and plain values (a pickle that would run
    code when loaded): refused, never executed."""


def load_training_state(path: str | Path) -> dict[str, Any] | None:
    """The training state beside a checkpoint (step, optimizer state, RNG), loaded with
    `weights_only=True`: tensors, numbers, strings and containers only. A file that needs anything
    else to load is a planted or foreign pickle and is refused with UnsafeTrainingState."""
    p = Path(path) / TRAINING_STATE_FILE
    if not p.is_file():
        return None
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsafeTrainingState(
            f"{p}: not loaded: it holds objects other than tensors and plain values ({first[:300]}); "
            "a training state written by this trainer never does"
        ) from None
    if not isinstance(state, dict):
        raise UnsafeTrainingState(f"{p}: not a training state (a {type(state).__name__})")
    return state


def read_metadata(path: str | Path) -> dict[str, Any]:
    p = Path(path) / METADATA_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
