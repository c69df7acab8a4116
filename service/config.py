"""The daemon's configuration: one TOML or YAML file (optional), then DFLASH_* environment
variables, then command-line flags, each overriding the one before.

With no file at all the daemon serves the embedded default (tiny target, bundled dataset) on the
CPU, or on the GPU(s) when CUDA is present.

Environment: DFLASH_<FIELD> for top-level fields (DFLASH_PORT, DFLASH_DATA_DIR, DFLASH_AUTH_TOKEN,
...), DFLASH_ENGINE__<FIELD> for the engine section (DFLASH_ENGINE__WARMUP_DELAY_SECONDS). Lists
are JSON (`["cuda:0","cuda:1"]`) or comma-separated (`cuda:0,cuda:1`).
"""
from __future__ import annotations

import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "DFLASH_"
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file, variable or field."""


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$DFLASH_DATA_DIR, else the per-user data directory; never the current directory."""
    if env.get("DFLASH_DATA_DIR"):
        return Path(env["DFLASH_DATA_DIR"]).expanduser()
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    base = env.get("XDG_DATA_HOME") or str(home / ".local" / "share")
    return Path(base).expanduser() / "dflash-trainer"


def embedded_assets_dir() -> Path:
    from dflash_core.defaults import ASSETS

    return ASSETS


class EngineSettings(BaseModel):
    """Maps onto dflash_core's EngineConfig. Unset values take the embedded default's."""

    model_config = ConfigDict(extra="forbid")

    target_path: Path | None = Field(None, description="HF checkpoint dir of the target; unset = embedded tiny target")
    target_random_init: bool = Field(False, description="the target_path architecture with random weights (benchmarks, dry runs)")
    target_devices: list[typing.Annotated[str, Field(pattern=DEVICE_PATTERN)]] | None = Field(None, min_length=1)
    drafter_devices: list[typing.Annotated[str, Field(pattern=DEVICE_PATTERN)]] | None = Field(None, min_length=1)
    seq_len: int | None = Field(None, ge=2)
    num_anchors: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=2)
    drafter_layers: int | None = Field(None, ge=1)
    drafter_intermediate_size: int | None = Field(None, ge=1)
    target_layer_ids: list[int] | None = Field(None, min_length=1)
    mask_token: str | None = None
    attention: Literal["auto", "flex", "dense"] = "auto"
    compile: bool | None = None
    compile_scope: Literal["attention", "layer", "step"] | None = Field(
        None, description="what torch.compile covers on CUDA: flex_attention only, one decoder layer "
                          "(+ BlockMask and loss chunks), or the whole drafter forward")
    flex_q_splits: int = Field(1, ge=1, le=64, description="queries as this many flex batch entries (1 is fastest measured)")
    loss_kernel: Literal["auto", "compiled", "triton"] = Field(
        "auto", description="lm_head + CE chunks: compiled by inductor, or a two-pass Triton kernel (CUDA only); "
                            "auto: triton when every drafter is on CUDA")
    working_weights: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="weights the drafter computes with: the fp32 masters (cast every step), or bf16 copies "
                            "of the weight matrices beside fp32 masters (CUDA only); auto: bf16 when every drafter "
                            "is on CUDA")
    init_seed: int = 0
    warmup_delay_seconds: float = Field(0.0, ge=0, description="pause per warmup phase, to observe warming in tests")
    inductor_cache_dir: Path | None = Field(None, description="default <data_dir>/inductor-cache")
    compile_workers: Literal["early", "lazy"] = Field(
        "early", description="inductor's Triton worker pool: started when the build starts (ready by the first "
                             "drafter compile), or lazily by torch at the first compile")
    queue_depth: int = Field(4, ge=1)

    @field_validator("target_path", "inductor_cache_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    def shape_values(self) -> tuple[int, int, int]:
        """(seq_len, num_anchors, block_size) the engine will compile for."""
        from dflash_core.defaults import DEFAULT_SHAPE_CPU

        return (self.seq_len or DEFAULT_SHAPE_CPU.seq_len, self.num_anchors or DEFAULT_SHAPE_CPU.num_anchors,
                self.block_size or DEFAULT_SHAPE_CPU.block_size)

    def to_engine_config(self, data_dir: Path):
        """The EngineConfig the daemon builds its engine with."""
        from dflash_core.config import ShapeConfig
        from dflash_core.defaults import DEFAULT_DRAFTER_LAYERS, DEFAULT_TARGET_LAYER_IDS
        from dflash_core.devices import default_devices
        from dflash_core.engine import EngineConfig

        embedded = self.target_path is None
        auto_target, auto_drafter = default_devices()
        if self.target_layer_ids is not None:
            layer_ids = list(self.target_layer_ids)
        else:  # the tiny target needs explicit ids; a real target takes the reference rule
            layer_ids = list(DEFAULT_TARGET_LAYER_IDS) if embedded else None
        seq_len, num_anchors, block_size = self.shape_values()
        try:
            shape = ShapeConfig(seq_len=seq_len, num_anchors=num_anchors, block_size=block_size)
        except ValueError as e:
            raise ConfigError(f"engine: {e}") from None
        optional = {"compile_scope": self.compile_scope} if self.compile_scope is not None else {}
        return EngineConfig(
            **optional,
            target_path=str(self.target_path) if self.target_path else None,
            target_random_init=self.target_random_init,
            target_devices=list(self.target_devices or auto_target),
            drafter_devices=list(self.drafter_devices or auto_drafter),
            shape=shape,
            drafter_layers=self.drafter_layers or DEFAULT_DRAFTER_LAYERS,
            target_layer_ids=layer_ids,
            drafter_intermediate_size=self.drafter_intermediate_size,
            mask_token=self.mask_token,
            attention=self.attention,
            compile=self.compile,
            flex_q_splits=self.flex_q_splits,
            loss_kernel=self.loss_kernel,
            working_weights=self.working_weights,
            init_seed=self.init_seed,
            inductor_cache_dir=str(self.inductor_cache_dir or data_dir / "inductor-cache"),
            compile_workers=self.compile_workers,
            warmup_delay_seconds=self.warmup_delay_seconds,
            queue_depth=self.queue_depth,
        )


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Field(default_factory=default_data_dir)
    auth_token: str | None = Field(None, description="bearer token required on POST endpoints when set")
    dataset_roots: list[Path] | None = Field(None, description="default: data_dir and the embedded assets")
    output_roots: list[Path] | None = Field(None, description="default: data_dir")
    log_json: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_timeout_seconds: float = Field(120.0, gt=0, description="how long SIGTERM waits for the job's checkpoint")
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @field_validator("data_dir")
    @classmethod
    def _expand_data_dir(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @field_validator("dataset_roots", "output_roots")
    @classmethod
    def _expand_roots(cls, v: list[Path] | None) -> list[Path] | None:
        return [p.expanduser().absolute() for p in v] if v is not None else None

    @field_validator("auth_token")
    @classmethod
    def _blank_token_is_none(cls, v: str | None) -> str | None:
        return v if v else None

    def resolved_dataset_roots(self) -> list[Path]:
        roots = self.dataset_roots if self.dataset_roots is not None else [self.data_dir, embedded_assets_dir()]
        return [r.resolve() for r in roots]

    def resolved_output_roots(self) -> list[Path]:
        roots = self.output_roots if self.output_roots is not None else [self.data_dir]
        return [r.resolve() for r in roots]

    @property
    def database_path(self) -> Path:
        return self.data_dir / "dflash.sqlite3"

    def engine_config(self):
        return self.engine.to_engine_config(self.data_dir)


# --------------------------------------------------------------------------- loading
_FILE_RELATIVE = ("data_dir", "dataset_roots", "output_roots")
_ENGINE_FILE_RELATIVE = ("target_path", "inductor_cache_dir")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: use a .toml, .yaml or .yml config file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping")
    # paths in a file are relative to the file, so a config works from any working directory
    base = path.parent.absolute()

    def rel(v):
        if isinstance(v, str) and v and not Path(v).expanduser().is_absolute():
            return str(base / v)
        return v

    for key in _FILE_RELATIVE:
        if key in data:
            data[key] = [rel(v) for v in data[key]] if isinstance(data[key], list) else rel(data[key])
    engine = data.get("engine")
    if isinstance(engine, dict):
        for key in _ENGINE_FILE_RELATIVE:
            if key in engine:
                engine[key] = rel(engine[key])
    return data


def _is_list_field(model: type[BaseModel], name: str) -> bool:
    ann = model.model_fields[name].annotation
    return any(typing.get_origin(a) is list for a in (ann, *typing.get_args(ann)))


def _env_value(model: type[BaseModel], name: str, raw: str, var: str) -> Any:
    if _is_list_field(model, name):
        if raw.strip().startswith("["):
            try:
                return json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{var}: invalid JSON list: {e}") from None
        return [p.strip() for p in raw.split(",") if p.strip()]
    if raw == "" and model.model_fields[name].default is None:
        return None
    return raw


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """DFLASH_* variables that name a config field (others, such as the client's DFLASH_URL, are not ours)."""
    out: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX):].lower()
        if key.startswith("engine__"):
            name = key[len("engine__"):]
            if name in EngineSettings.model_fields:
                engine[name] = _env_value(EngineSettings, name, raw, var)
        elif key in ServiceConfig.model_fields and key != "engine":
            out[key] = _env_value(ServiceConfig, key, raw, var)
    if engine:
        out["engine"] = engine
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        parts.append(f"{prefix}{loc}: {e['msg']}" if loc else f"{prefix}{e['msg']}")
    return "; ".join(parts)


def load_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """File (optional) < DFLASH_* environment < explicit overrides (command-line flags)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = _read_file(Path(path).expanduser()) if path else {}
    data = _merge(data, _env_overrides(env))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    if "data_dir" not in data:
        data["data_dir"] = default_data_dir(env)
    where = f"{path}: " if path else ""
    try:
        config = ServiceConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(where + format_validation_error(e)) from None
    target = config.engine.target_path
    if target is not None and not (target / "config.json").is_file():
        # caught here, not 10 s into the engine build (transformers would try the Hub with the name)
        raise ConfigError(f"{where}engine.target_path: {target} is not a model directory (no config.json)")
    drafters = config.engine.drafter_devices  # unset: chosen at build (the engine refuses it there)
    if drafters and not all(d.startswith("cuda") for d in drafters):
        for key, cuda_only in (("loss_kernel", "triton"), ("working_weights", "bf16")):
            if getattr(config.engine, key) == cuda_only:
                raise ConfigError(f"{where}engine.{key}: {cuda_only!r} runs on CUDA only; drafter devices are {drafters}")
    return config
