"""Drafter checkpoints in the format the z-lab `DFlashDraftModel`, SGLang and vLLM load:
a directory with `config.json` (Qwen3 config + DFlash fields) and `model.safetensors` (drafter
weights only: no embedding, no LM head), plus our training state beside them for resume.
Every checkpoint is written into a temporary directory and renamed into place, so a crash never
leaves a torn checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import re
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import DrafterConfig
from .confine import ConfinedDir
from .drafter import DFlashDrafter
from .recipes import RECIPES, layout_of_config, recipe_named

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
# what resume reads, beside the files a serving engine loads: the optimizer state, the step and
# data position, the RNG, and the fp32 master weights when model.safetensors holds another dtype
TRAINING_DIR = "training_state"
MASTER_WEIGHTS_FILE = "master_weights.safetensors"
MODELING_FILE = "modeling_dflash.py"
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METADATA_FILE = "dflash_metadata.json"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def expected_keys(num_layers: int, recipe: str = "dflash", markov_head_type: str = "vanilla") -> set[str]:
    """The weight names of a checkpoint: the DFlash backbone's and the recipe's heads'."""
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        keys |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys | recipe_named(recipe).hooks().head_keys(markov_head_type)


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
        "auto_map": {"AutoModel": f"{MODELING_FILE[:-3]}.DFlashDraftModel"},
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
        "layer_types": cfg.layer_types,
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash_config(cfg),
        # vLLM's spelling of the captured layers (the input of layer id + 1 = the output of id)
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        # every drafter layer attends both ways within a block (vLLM and the reference read it)
        "is_causal": False,
        **layout_fields(cfg),
        **recipe_fields(cfg),
    }


def dflash_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The `dflash_config` every DFlash loader reads (vLLM, SGLang, speculators, z-lab)."""
    return {
        "mask_token_id": cfg.mask_token_id,
        **({"mask_token": cfg.mask_token} if cfg.mask_token else {}),
        "target_layer_ids": list(cfg.target_layer_ids),
        "input_embedding_scale": cfg.input_embedding_scale,
        # vLLM attends within sliding_window only when this says so (its default: full attention)
        **({"use_swa": True} if cfg.sliding_window is not None else {}),
        "sample_from_anchor": cfg.block_layout.sample_from_anchor,
    }


def layout_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The block layout, stated always, where the readers look for it: speculators reads the
    top-level `sample_from_anchor` (its DSpark default true, its DFlash default false: a missing
    field is a guess), vLLM's DSpark speculator `dspark_bonus_anchor` (true: the fill-in 1 + N
    block), dflash_config.sample_from_anchor for the loaders that read only dflash_config."""
    layout = cfg.block_layout
    return {
        "sample_from_anchor": layout.sample_from_anchor,
        "dspark_bonus_anchor": not layout.sample_from_anchor,
        "block_layout": layout.name,
        "num_speculative_tokens": cfg.draft_length,
    }


def recipe_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """What the recipe adds to config.json (DSpark: its class, the heads' fields)."""
    return recipe_named(cfg.recipe).hooks().export_fields(cfg, dflash_config(cfg))


def config_from_hf(d: dict[str, Any]) -> DrafterConfig:
    """The drafter a config.json describes; its layout as stated (recipes.layout_of_config), a
    config that states none read as the fill_in it was written in."""
    dflash = d.get("dflash_config") or {}
    recipe = RECIPES.of_config(d)
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
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        mask_token=dflash.get("mask_token"),
        sliding_window=_sliding_window(d),
        recipe=recipe.name,
        markov_rank=int(dflash.get("markov_rank") or 0) if recipe.heads else 0,
        markov_head_type=str(dflash.get("markov_head_type") or "vanilla"),
        layout=layout_of_config(d).name,
        num_anchors=d.get("num_anchors") if isinstance(d.get("num_anchors"), int) else None,
    )


def _sliding_window(d: dict[str, Any]) -> int | None:
    """The drafter's window: config.sliding_window where its layers are sliding_attention (every
    layer: the drafter has one window for all of them)."""
    types = d.get("layer_types") or []
    if "sliding_attention" not in types:
        return None
    if set(types) != {"sliding_attention"}:
        raise ValueError(f"layer_types {types}: a drafter's layers must all be full or all sliding_attention")
    window = d.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ValueError("sliding_attention layers need a positive sliding_window")
    return window


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
    export_dtype: str = "fp32",
) -> Path:
    """Write CPU weights (and state) as a checkpoint directory, atomically (temp dir + rename).

    The directory is what a serving engine loads: config.json (with `auto_map` naming the
    modeling file beside it), modeling_dflash.py, and model.safetensors in `export_dtype`. The
    training state, which resume reads, sits in its `training_state/` subdirectory (with the fp32
    master weights when the export dtype is not fp32). Files are 0644 and directories 0755, so a
    serving process of another user can read them from a shared volume.
    With `parent` (the directory `path` is in, held open by ConfinedDir), every step goes through
    its descriptor: a path component swapped for a symlink cannot redirect the write."""
    if export_dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_dtype must be one of {sorted(EXPORT_DTYPES)}, got {export_dtype!r}")
    final = Path(path)
    missing = expected_keys(config.num_hidden_layers, config.recipe, config.markov_head_type) ^ set(weights)
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
                dt = EXPORT_DTYPES[export_dtype]
                exported = {k: v.to(dt).contiguous() for k, v in weights.items()}
                save_file(exported, tmp.at(WEIGHTS_FILE), metadata={"format": "pt"})
                Path(tmp.at(CONFIG_FILE)).write_text(json.dumps(hf_config(config, dt), indent=2) + "\n")
                Path(tmp.at(MODELING_FILE)).write_bytes((Path(__file__).parent / MODELING_FILE).read_bytes())
                if metadata is not None:
                    Path(tmp.at(METADATA_FILE)).write_text(json.dumps(metadata, indent=2, default=str) + "\n")
                if training_state is not None:
                    os.mkdir(TRAINING_DIR, 0o755, dir_fd=tmp.fd)
                    train_dir = f"{TRAINING_DIR}/"
                    torch.save(training_state, tmp.at(train_dir + TRAINING_STATE_FILE))
                    if dt != torch.float32:
                        masters = {k: v.float().contiguous() for k, v in weights.items()}
                        save_file(masters, tmp.at(train_dir + MASTER_WEIGHTS_FILE), metadata={"format": "pt"})
                _publish(tmp)
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


def _publish(directory: ConfinedDir) -> None:
    """fsync every file and directory of a checkpoint being written and give them the modes a
    reader of another user needs (0644 files, 0755 directories)."""
    os.chmod(directory.fd, 0o755)
    stack = [(directory.fd, "")]
    while stack:
        fd, prefix = stack.pop()
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.chmod(sub, 0o755)
                stack.append((sub, prefix + entry.name + "/"))
                continue
            f = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                os.fchmod(f, 0o644)
                os.fsync(f)
            finally:
                os.close(f)
        os.fsync(fd)
        if fd != directory.fd:
            os.close(fd)


def export_checkpoint(src: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """A serving directory (config.json with auto_map, modeling_dflash.py, model.safetensors in
    `dtype`, no training state) from any drafter checkpoint, older layouts included; `out` must
    not exist. "auto": the dtype of the target the checkpoint records (fp32 where it records
    none). A target recorded by a path (older checkpoints) is recorded by its identity instead."""
    from .target_identity import resolve_export_dtype, target_identity

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; export writes a new directory")
    cfg = read_config(src)
    weights = load_weights(src, cfg.num_hidden_layers, masters=True)
    metadata = read_metadata(src) or None
    if metadata is not None and isinstance(metadata.get("target"), str):
        old = Path(metadata["target"])
        metadata["target"] = target_identity(old) if (old / CONFIG_FILE).is_file() else None
    recorded = (metadata or {}).get("target") or {}
    dtype = resolve_export_dtype(dtype, recorded.get("dtype") if isinstance(recorded, dict) else None)
    return write_checkpoint(out, cfg, weights, metadata=metadata, export_dtype=dtype)


# config.json's sizes: whole numbers, at least 1 (a string or a float there is a damaged file)
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "num_target_layers",
)


def _json_object(p: Path, what: str) -> dict[str, Any]:
    """The JSON object file `p` holds; a ValueError naming it where it holds none (`what`: what
    it should be)."""
    try:
        value = json.loads(p.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{p}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{p}: not {what} (a JSON object)")
    return value


def read_config(path: str | Path) -> DrafterConfig:
    """The drafter config.json describes; a ValueError naming the file where it is not one."""
    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p}: not a drafter checkpoint (no {CONFIG_FILE})")
    d = _json_object(p, "a drafter config")
    try:
        cfg = config_from_hf(d)
    except KeyError as e:
        raise ValueError(f"{p}: not a drafter config: no {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{p}: not a drafter config: {e}") from None
    for name in _SIZE_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{p}: {name} is {value!r}, not a whole number of at least 1")
    bad_ids = [i for i in (cfg.mask_token_id, *cfg.target_layer_ids) if isinstance(i, bool) or not isinstance(i, int)]
    if bad_ids:
        raise ValueError(f"{p}: mask_token_id and target_layer_ids must be whole numbers, got {bad_ids[0]!r}")
    return cfg


def load_weights(path: str | Path, num_layers: int, *, masters: bool = False) -> dict[str, torch.Tensor]:
    """The drafter weights of a checkpoint; masters: the fp32 weights of record (what resume
    continues from) where the exported model.safetensors holds another dtype."""
    master_file = Path(path) / TRAINING_DIR / MASTER_WEIGHTS_FILE
    weights = master_file if masters and master_file.is_file() else Path(path) / WEIGHTS_FILE
    try:
        state = load_file(str(weights))
    except SafetensorError as e:  # a truncated or overwritten file
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    cfg = read_config(path) if (Path(path) / CONFIG_FILE).is_file() else None
    diff = expected_keys(num_layers, *((cfg.recipe, cfg.markov_head_type) if cfg else ())) ^ set(state)
    if diff:
        raise ValueError(f"{path}: checkpoint keys differ from the DFlash format: {sorted(diff)[:8]}")
    return state


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    cfg = read_config(path)
    drafter = DFlashDrafter(cfg)
    try:
        drafter.load_state_dict(load_weights(path, cfg.num_hidden_layers))
    except RuntimeError as e:  # weights of other shapes than config.json says
        raise ValueError(f"{path}: the weights do not fit its {CONFIG_FILE}: {str(e)[:300]}") from None
    return drafter.to(device=device, dtype=dtype) if dtype else drafter.to(device)


class UnsafeTrainingState(ValueError):
    """A training state file that holds more than tensors and plain values (a pickle that would run
    code when loaded): refused, never executed."""


def load_training_state(path: str | Path) -> dict[str, Any] | None:
    """The training state of a checkpoint (step, optimizer state, RNG), loaded with
    `weights_only=True`: tensors, numbers, strings and containers only. A file that needs anything
    else to load is a planted or foreign pickle and is refused with UnsafeTrainingState.
    Checkpoints written before the training_state/ subdirectory keep it at the top level."""
    p = Path(path) / TRAINING_DIR / TRAINING_STATE_FILE
    if not p.is_file():
        p = Path(path) / TRAINING_STATE_FILE
    if not p.is_file():
        return None
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own message advises loading with weights_only=False, which would run the file's code
        needs = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f" (it needs {needs.group(1)[:200]})" if needs else ""
        raise UnsafeTrainingState(
            f"{p}: not loaded: it holds objects other than tensors and plain values{what}; "
            "a training state written by this trainer never does, so it is not loaded at all"
        ) from None
    if not isinstance(state, dict):
        raise UnsafeTrainingState(f"{p}: not a training state (a {type(state).__name__})")
    return state


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The checkpoint's dflash_metadata.json ({} where it has none); a ValueError naming the file
    where it is damaged."""
    p = Path(path) / METADATA_FILE
    return _json_object(p, "checkpoint metadata") if p.is_file() else {}
