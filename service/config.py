"""The daemon's configuration: one TOML or YAML file (optional), then DFLASH_* environment
variables, then command-line flags, each overriding the one before.

With no file at all the daemon serves the embedded default (tiny target, bundled dataset) on the
CPU, or on the GPU(s) when CUDA is present.

Environment: DFLASH_<FIELD> for top-level fields (DFLASH_PORT, DFLASH_DATA_DIR, DFLASH_AUTH_TOKEN,
...), DFLASH_ENGINE__<FIELD> for the engine section (DFLASH_ENGINE__DRAFTER_DEVICES). Lists
are JSON (`["cuda:0","cuda:1"]`) or comma-separated (`cuda:0,cuda:1`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
import typing
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dflash_core.data_home import default_data_dir
from dflash_core.engine.config import EngineConfig

ENV_PREFIX = "DFLASH_"


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file, variable or field."""


def is_loopback_host(host: str) -> bool:
    """A bind address (or Host name) that only this machine can reach."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_wildcard_host(host: str) -> bool:
    """0.0.0.0 / :: (every address of the machine)."""
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_unspecified
    except ValueError:
        return False


def _token(value: str | None, name: str) -> str | None:
    """Surrounding whitespace is not part of a token (a secret file's trailing newline, an indented
    value): stripped here as it is from the presented one. Control characters cannot travel in an
    HTTP header, so such a token could never be presented."""
    if value is None:
        return None
    value = value.strip()
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ValueError(f"{name} contains a control character; it could never be sent in an HTTP header")
    return value or None


def _host_name(value: str) -> str:
    host = value.strip().lower()
    if host == "*":
        return host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or any(c in host for c in "/:@?# ") or any(unicodedata.category(c)[0] in "CZ" for c in host):
        raise ValueError(f"{value!r} is not a host name (give the name only: no scheme, port or path)")
    return host.rstrip(".")


def normalize_origin(value: str) -> str | None:
    """scheme://host[:port] in lower case with the scheme's default port dropped, as browsers send
    it in the Origin header; None when `value` is not such an origin."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment:
        return None
    if parts.username is not None or parts.password is not None:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    default = 80 if parts.scheme == "http" else 443
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def embedded_assets_dir() -> Path:
    from dflash_core.defaults import ASSETS

    return ASSETS


Tracker = Literal["tensorboard", "wandb", "mlflow"]
DEFAULT_TRACKER: Tracker = "tensorboard"


# A job during which the daemon died more than `max_crash_resumes` times in a row (this default
# unless configured) without the job reaching a new checkpoint is failed instead of resumed again
# (a job that kills the process, e.g. through host OOM, would otherwise crash-loop the daemon
# forever); a crash after a new checkpoint does not count, since that job gets further each time.
MAX_CRASH_RESUMES = 5


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Field(default_factory=default_data_dir)
    auth_token: str | None = Field(
        None, description="bearer token required on POST endpoints when set (and on reads with protect_reads)"
    )
    read_token: str | None = Field(
        None, description="bearer token required on GET endpoints except /healthz, /livez and /metrics when set"
    )
    protect_reads: bool = Field(False, description="auth_token (or read_token) also guards the GET endpoints")
    allow_unauthenticated: bool = Field(
        False, description="serve on a non-loopback address without auth_token (anyone who reaches it may submit)"
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header names accepted besides localhost names and the bind address; '*' accepts any",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins (scheme://host[:port]) allowed to POST besides the daemon's own",
    )
    max_event_streams: int = Field(64, ge=1, le=100_000, description="open ?follow=true event streams at most")
    max_crash_resumes: int = Field(
        MAX_CRASH_RESUMES,
        ge=0,
        le=1000,
        description="a job during which the daemon died more than this many times in a row without a new "
        "checkpoint is failed instead of resumed again (POST /jobs/{id}/resume still continues it)",
    )
    request_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="time a client has to deliver a whole request (head and body)"
    )
    keep_alive_timeout_seconds: int = Field(5, ge=1, le=3600, description="an idle keep-alive connection is closed")
    dataset_roots: list[Path] | None = Field(None, description="default: data_dir and the embedded assets")
    output_roots: list[Path] | None = Field(None, description="default: data_dir")
    log_json: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    report_to: list[Tracker] = Field(
        default_factory=lambda: [DEFAULT_TRACKER],
        description="experiment trackers of every job unless its spec says otherwise (TensorBoard event files "
        "under the job's output_dir/tensorboard; wandb or mlflow where installed); [] for none",
    )
    shutdown_timeout_seconds: float = Field(120.0, gt=0, description="how long SIGTERM waits for the job's checkpoint")
    distributed_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="multi-host: how long a rank waits for the others in a step (longer than rank 0's evaluation) "
        "before a hung rank fails the job; a rank that dies fails it at once",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _no_empty_data_dir(cls, v: Any) -> Any:
        # an empty path would be the current directory, which the daemon never writes to
        if isinstance(v, str) and not v.strip():
            raise ValueError("an empty path; give the data directory")
        return v

    @field_validator("data_dir")
    @classmethod
    def _expand_data_dir(cls, v: Path) -> Path:
        v = v.expanduser().absolute()
        if v.exists() and not v.is_dir():
            raise ValueError(f"{v} is a file, not a directory")
        return v

    @field_validator("dataset_roots", "output_roots")
    @classmethod
    def _expand_roots(cls, v: list[Path] | None) -> list[Path] | None:
        return [p.expanduser().absolute() for p in v] if v is not None else None

    @field_validator("auth_token", "read_token")
    @classmethod
    def _clean_token(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _token(v, info.field_name or "token")

    @field_validator("allowed_hosts")
    @classmethod
    def _clean_hosts(cls, v: list[str]) -> list[str]:
        return [_host_name(h) for h in v]

    @field_validator("allowed_origins")
    @classmethod
    def _clean_origins(cls, v: list[str]) -> list[str]:
        out = []
        for raw in v:
            origin = normalize_origin(raw)
            if origin is None:
                raise ValueError(f"{raw!r} is not an origin: give scheme://host[:port], e.g. https://ui.example.com")
            out.append(origin)
        return out

    @model_validator(mode="after")
    def _reads_need_a_token(self) -> ServiceConfig:
        if self.protect_reads and self.auth_token is None and self.read_token is None:
            raise ValueError("protect_reads needs auth_token or read_token")
        return self

    @property
    def reads_protected(self) -> bool:
        return self.protect_reads or self.read_token is not None

    def read_tokens(self) -> list[str]:
        """Tokens accepted on guarded reads: the read token, and the auth token (who may write may read)."""
        return [t for t in (self.read_token, self.auth_token) if t is not None]

    def exposure_problem(self) -> str | None:
        """Why this config must not serve, or None: a non-loopback bind without a token lets anyone
        who reaches the port submit jobs that read and write under the configured roots."""
        if is_loopback_host(self.host) or self.auth_token is not None or self.allow_unauthenticated:
            return None
        return (
            f"host {self.host!r} is reachable from other machines, and no auth_token is set: anyone who "
            "reaches the port could submit and cancel jobs. Set auth_token (or DFLASH_AUTH_TOKEN), bind "
            "127.0.0.1, or set allow_unauthenticated = true to accept that"
        )

    def resolved_dataset_roots(self) -> list[Path]:
        roots = self.dataset_roots if self.dataset_roots is not None else [self.data_dir, embedded_assets_dir()]
        return [r.resolve() for r in roots]

    def resolved_output_roots(self) -> list[Path]:
        roots = self.output_roots if self.output_roots is not None else [self.data_dir]
        return [r.resolve() for r in roots]

    @property
    def database_path(self) -> Path:
        return self.data_dir / "dflash.sqlite3"


# --------------------------------------------------------------------------- loading
_FILE_RELATIVE = ("data_dir", "dataset_roots", "output_roots")
_ENGINE_FILE_RELATIVE = ("target_path", "inductor_cache_dir")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (as TOML does): the last one
    would win silently."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):  # the safe loader's own check refuses it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        else:
            raise ConfigError(f"{path}: use a .toml, .yaml or .yml config file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deep") from None
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
        key = var[len(ENV_PREFIX) :].lower()
        if key.startswith("engine__"):
            name = key[len("engine__") :]
            if name in EngineConfig.model_fields:
                engine[name] = _env_value(EngineConfig, name, raw, var)
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


def load_config(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None, overrides: dict[str, Any] | None = None
) -> ServiceConfig:
    """File (optional) < DFLASH_* environment < explicit overrides (command-line flags)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = _read_file(Path(path).expanduser()) if path else {}
    data = _merge(data, _env_overrides(env))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    if "data_dir" not in data:
        try:
            data["data_dir"] = default_data_dir(env)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    where = f"{path}: " if path else ""
    try:
        config = ServiceConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(where + format_validation_error(e)) from None
    target = config.engine.target_path
    if target is not None and not (target / "config.json").is_file():
        # caught here, not 10 s into the engine build (transformers would try the Hub with the name)
        raise ConfigError(f"{where}engine.target_path: {target} is not a model directory (no config.json)")
    return config
