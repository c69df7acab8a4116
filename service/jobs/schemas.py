"""What a client may submit (JobSpec), and its translation into the engine's TrainJob with every
path checked against the configured roots."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .suggest import unknown_field_message

BUILTIN_SCHEME = "builtin://"
BUILTIN_DATASETS = ("train", "heldout")
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
MAX_TEMPLATE_BYTES = 1024 * 1024


class SpecError(ValueError):
    """An invalid job spec; `field` names the offending field (e.g. `datasets[0]`)."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


class InvalidSpec(ValueError):
    """A spec that fails validation: every problem as {field, message}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


class JobSpec(BaseModel):
    """A training job as submitted over HTTP (POST /jobs). Unknown fields are rejected, so a typo
    never silently falls back to a default."""

    # strict: "7", true or 5.0 are not a step count; a JSON number is still fine for a float field
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_strip_whitespace=True, strict=True)

    name: str | None = Field(None, max_length=200)
    submission_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="idempotency key: resubmitting the same spec returns the same job",
    )
    datasets: list[str] = Field(
        min_length=1,
        max_length=1024,
        description="conversation datasets: JSONL, JSON array or parquet files, directories of such shards, "
        "datasets.save_to_disk directories, or builtin://train|heldout",
    )
    steps: int | None = Field(None, ge=1, le=10**9)
    epochs: float | None = Field(None, gt=0, le=10**6)
    # bounded so that no setting alone can make the weights non-finite: lr * weight_decay <= 1 keeps
    # AdamW's decay factor in [0, 1]; a loss_gamma below float32's range makes the position weights NaN
    learning_rate: float = Field(6e-4, gt=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="max gradient norm; 0 disables clipping")
    adam_betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    grad_accum: int = Field(1, ge=1, le=4096)
    loss_gamma: float | None = Field(None, ge=0.01, le=1e6, description="position-weight decay; default by block size")
    loss: Any = Field(
        None,
        description='"ce" (default), "kl", "tv", or a weighted mix such as {"ce": 0.1, "tv": 0.9}; kl and tv '
        'need a daemon started with [engine] teacher = true; "conf" (a dspark daemon) weights the confidence head. '
        "Default: ce, or on a dspark daemon 0.1 ce + 0.9 tv + 1.0 conf",
    )
    position_weights: Literal["decay", "dpace"] = Field(
        "decay", description="decay: exp(-(k-1)/loss_gamma); dpace: D-PACE weights (teacher daemon)"
    )
    dpace_alpha: float = Field(0.5, ge=0, le=1, description="D-PACE smoothing alpha")
    recipe: Literal["dflash", "dspark"] | None = Field(
        None, description="must equal the daemon's [engine] recipe; unset: the daemon's"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1)
    output_dir: str | None = Field(None, description="default <data_dir>/jobs/<job id>")
    checkpoint_interval: int = Field(100, ge=1, le=10**9)
    keep_checkpoints: int = Field(3, ge=1, le=10**6)
    init_from: str | None = Field(None, description="drafter checkpoint to start from")
    skip_bad_lines: bool = False
    chat_template: str | None = Field(None, description="a Jinja chat template file; default: the tokenizer's")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="experiment trackers for this job (TensorBoard event files under output_dir/tensorboard; "
        "wandb or mlflow where installed); default: the daemon's report_to",
    )
    export_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="dtype of each checkpoint's model.safetensors; auto: the target's (bf16 for a bf16 target); "
        "resume always has the fp32 masters",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='options the chat template reads, e.g. {"enable_thinking": false}'
    )
    eval_prompts: str | None = Field(None, description="JSONL of held-out prompts for acceptance length")
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    eval_interval: int = Field(0, ge=0, le=10**9)
    eval_max_prompts: int = Field(16, ge=1, le=100_000)
    eval_max_new_tokens: int = Field(48, ge=1, le=32_768)
    seq_len: int | None = Field(None, ge=2, le=10**8)
    num_anchors: int | None = Field(None, ge=1, le=10**8)
    block_size: int | None = Field(None, ge=2, le=10**4)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> JobSpec:
        if len(canonical_json(self.chat_template_kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise SpecError("chat_template_kwargs", f"larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        duplicates = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if duplicates:
            raise SpecError("datasets", f"listed more than once: {', '.join(duplicates)}")
        if self.steps is None and self.epochs is None:
            raise SpecError("steps", "give steps or epochs")
        if self.steps is not None and self.epochs is not None:
            raise SpecError("epochs", "give steps or epochs, not both")
        if self.loss is not None:
            from dflash_core.step.objective_spec import parse_loss

            try:
                parse_loss(self.loss)
            except ValueError as e:
                raise SpecError("loss", str(e)) from None
        for i, b in enumerate(self.adam_betas):
            if not 0 <= b < 1:
                raise SpecError(f"adam_betas[{i}]", f"{b} must lie in [0, 1)")
        return self

    def fingerprint(self) -> str:
        """Identity of the spec for idempotent resubmission: defaults filled in, keys sorted."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode()).hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def field_path(loc: tuple) -> str:
    """('datasets', 0) -> 'datasets[0]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def spec_errors(err: ValidationError, model: type[BaseModel] | None = None) -> list[dict[str, str]]:
    """pydantic errors as [{field, message}], with our own SpecError messages unwrapped; an
    unknown field gets a suggestion from `model`'s fields (default: JobSpec's)."""
    model = JobSpec if model is None else model
    out = []
    for e in err.errors():
        ctx_error = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SpecError):
            out.append({"field": ctx_error.field, "message": ctx_error.message})
            continue
        name = field_path(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            # a top-level field: suggest one of the spec's (a nested one has no fields of its own here)
            unknown = str(e["loc"][-1])
            fields = model.model_fields if len(e["loc"]) == 1 else ()
            out.append({"field": name, "message": unknown_field_message(unknown, fields, other_kind(model, unknown))})
        else:
            out.append({"field": name or "body", "message": e["msg"]})
    return out


def parse_spec(body: Any) -> Any:
    """Validate a decoded JSON body: a JobSpec (`kind` "train", the default) or a RegenerateSpec
    (`kind` "regenerate"); raises InvalidSpec listing every problem."""
    if not isinstance(body, dict):
        raise InvalidSpec([{"field": "body", "message": f"expected a JSON object, got {type(body).__name__}"}])
    # before anything walks the values recursively (validation, the fingerprint's JSON encoding)
    from dflash_core.data.bounded import MAX_JSON_DEPTH, too_deep

    deep = [str(k) for k, v in body.items() if too_deep(v, MAX_JSON_DEPTH - 1)]
    if deep:
        raise InvalidSpec([{"field": k, "message": f"nested deeper than {MAX_JSON_DEPTH} levels"} for k in deep])
    kind = body.get("kind", "train")
    from .regenerate_spec import RegenerateSpec

    model: type[BaseModel] = RegenerateSpec if kind == "regenerate" else JobSpec
    try:
        if kind == "regenerate":
            return RegenerateSpec.model_validate(body)
        if kind != "train":
            raise InvalidSpec([{"field": "kind", "message": f"{kind!r}: the job kinds are 'train' and 'regenerate'"}])
        return JobSpec.model_validate({k: v for k, v in body.items() if k != "kind"})
    except ValidationError as e:
        raise InvalidSpec(spec_errors(e, model)) from None


def other_kind(model: type[BaseModel], name: str) -> str | None:
    """The job kind whose spec has the field `name` when `model`'s has not: a train spec given a
    regeneration's `max_new_tokens` is pointed at `"kind": "regenerate"`, and back."""
    from .regenerate_spec import RegenerateSpec

    for kind, other in (("regenerate", RegenerateSpec), ("train", JobSpec)):
        if other is not model and name in other.model_fields and name not in model.model_fields:
            return kind
    return None


# --------------------------------------------------------------------------- paths
def _check_under_roots(raw: str, field_name: str, roots: list[Path], base: Path) -> Path:
    """Resolve `raw` (relative to `base`) with symlinks followed; it must lie under one of `roots`."""
    if not raw:
        raise SpecError(field_name, "empty path")
    if "\x00" in raw:
        raise SpecError(field_name, "path contains a NUL byte")
    if raw.startswith("~") and not (raw == "~" or raw.startswith("~/")):
        # the same answer whether or not that user exists: no account names are probed through paths
        raise SpecError(field_name, f"{raw[:200]!r}: '~user' paths are not accepted; give the path itself")
    try:
        candidate = Path(raw).expanduser()
        if ".." in candidate.parts:
            raise SpecError(field_name, f"{raw!r}: '..' is not allowed in paths")
        if not candidate.is_absolute():
            candidate = base / candidate
        resolved = candidate.resolve(strict=False)  # follows every symlink that exists
    except (OSError, RuntimeError) as e:  # unknown ~user, symlink loop, name too long, no permission
        raise SpecError(
            field_name, f"{raw[:200]!r}: not a usable path ({getattr(e, 'strerror', None) or type(e).__name__})"
        ) from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise SpecError(
            field_name,
            f"{raw!r} is outside the allowed roots (symlinks followed; the daemon's dataset_roots / output_roots)",
        )
    return resolved


def resolve_builtin(raw: str, field_name: str, data_dir: Path) -> Path:
    """builtin://train|heldout -> the embedded default's bundled dataset under data_dir."""
    name = raw[len(BUILTIN_SCHEME) :]
    if name not in BUILTIN_DATASETS:
        raise SpecError(field_name, f"unknown builtin dataset {raw!r}; use builtin://train or builtin://heldout")
    from dflash_core.defaults import ensure_default_assets

    return getattr(ensure_default_assets(data_dir), name).resolve()


def resolve_dataset(raw: str, field_name: str, *, roots: list[Path], data_dir: Path) -> Path:
    if raw.startswith(BUILTIN_SCHEME):
        return resolve_builtin(raw, field_name, data_dir)
    path = _check_under_roots(raw, field_name, roots, data_dir)
    try:
        exists = path.exists()
    except OSError as e:
        raise SpecError(
            field_name, f"dataset {raw[:200]!r} cannot be read ({e.strerror or type(e).__name__})"
        ) from None
    if not exists:
        raise SpecError(field_name, f"dataset {raw!r} does not exist")
    return path


def check_dataset_readable(path: Path, field_name: str, *, skip_bad_lines: bool, given: str) -> None:
    """The dataset's layout, schema and first records, read now: what cannot be read is refused
    at submission rather than failing the job later, naming the dataset as `given` by the client."""
    from dflash_core.data.conversations import DatasetError
    from dflash_core.data.inspect import check_dataset

    try:
        check_dataset(path, skip_bad_lines=skip_bad_lines, name=given)
    except DatasetError as e:
        raise SpecError(field_name, str(e)) from None
    except OSError as e:
        raise SpecError(field_name, f"the dataset cannot be read ({e.strerror or type(e).__name__})") from None


def resolve_template(raw: str, *, roots: list[Path], data_dir: Path) -> Path:
    path = _check_under_roots(raw, "chat_template", roots, data_dir)
    try:
        if not path.is_file():
            raise SpecError("chat_template", f"{raw!r} is not a file")
        with path.open("rb") as f:  # bounded while reading, whatever its size says
            text = f.read(MAX_TEMPLATE_BYTES + 1)
        if len(text) > MAX_TEMPLATE_BYTES:
            raise SpecError("chat_template", f"{raw!r} is larger than {MAX_TEMPLATE_BYTES >> 20} MiB")
        text.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("chat_template", f"{raw!r} is not UTF-8 text") from None
    except OSError as e:
        raise SpecError("chat_template", f"{raw!r} cannot be read ({e.strerror or type(e).__name__})") from None
    return path


def resolve_output_dir(raw: str | None, *, roots: list[Path], data_dir: Path, job_id: str) -> Path:
    if raw is None:
        return (data_dir / "jobs" / job_id).resolve()
    path = _check_under_roots(raw, "output_dir", roots, data_dir)
    try:
        not_a_dir = path.exists() and not path.is_dir()
    except OSError as e:
        raise SpecError("output_dir", f"{raw[:200]!r} cannot be used ({e.strerror or type(e).__name__})") from None
    if not_a_dir:
        raise SpecError("output_dir", f"{raw!r} exists and is not a directory")
    return path


def resolve_checkpoint(raw: str, *, roots: list[Path], data_dir: Path) -> Path:
    path = _check_under_roots(raw, "init_from", roots, data_dir)
    try:
        is_checkpoint = (path / "config.json").is_file()
    except OSError as e:
        raise SpecError("init_from", f"{raw[:200]!r} cannot be read ({e.strerror or type(e).__name__})") from None
    if not is_checkpoint:
        raise SpecError("init_from", f"{raw!r} is not a drafter checkpoint directory (no config.json)")
    return path


def to_train_job(
    spec: JobSpec,
    *,
    job_id: str,
    data_dir: Path,
    dataset_roots: list[Path],
    output_roots: list[Path],
    job_outputs: Any = None,
):
    """The engine's job for this spec (a TrainJob, or a RegenerateJob for a RegenerateSpec): every
    path absolute and checked. job_outputs(id) -> (kind, state, output_dir) of a stored job, for
    datasets named job://<id> (a regeneration's output)."""
    from dflash_core.engine import TrainJob

    if getattr(spec, "kind", "train") == "regenerate":
        from .regenerate_spec import to_regenerate_job

        return to_regenerate_job(
            spec,  # type: ignore[arg-type]  # a RegenerateSpec (its kind says so)
            job_id=job_id,
            data_dir=data_dir,
            dataset_roots=dataset_roots,
            output_roots=output_roots,
        )
    jobs_read = _job_datasets(spec.datasets, job_outputs)
    dataset_roots = [*dataset_roots, *jobs_read.values()]

    if spec.report_to:
        from ..tracking import unavailable

        missing = unavailable(list(spec.report_to))
        if missing:
            raise SpecError("report_to", f"{', '.join(missing)}: not installed in the daemon's environment")
    resolved = [
        jobs_read.get(i) or resolve_dataset(d, f"datasets[{i}]", roots=dataset_roots, data_dir=data_dir)
        for i, d in enumerate(spec.datasets)
    ]
    seen: dict[Path, int] = {}
    for i, path in enumerate(resolved):
        if path in seen:  # two names for one dataset would train on it twice
            raise SpecError(f"datasets[{i}]", f"the same dataset as datasets[{seen[path]}]")
        seen[path] = i
        check_dataset_readable(path, f"datasets[{i}]", skip_bad_lines=spec.skip_bad_lines, given=spec.datasets[i])
    datasets = [str(p) for p in resolved]
    eval_prompts = None
    if spec.eval_prompts is not None:
        prompts = resolve_dataset(spec.eval_prompts, "eval_prompts", roots=dataset_roots, data_dir=data_dir)
        check_dataset_readable(prompts, "eval_prompts", skip_bad_lines=spec.skip_bad_lines, given=spec.eval_prompts)
        eval_prompts = str(prompts)
    chat_template = None
    if spec.chat_template is not None:
        chat_template = str(resolve_template(spec.chat_template, roots=dataset_roots, data_dir=data_dir))
    init_from = None
    if spec.init_from is not None:
        init_from = str(resolve_checkpoint(spec.init_from, roots=dataset_roots + output_roots, data_dir=data_dir))
    output_dir = resolve_output_dir(spec.output_dir, roots=output_roots, data_dir=data_dir, job_id=job_id)
    values = spec.model_dump(exclude={"name", "submission_id", "report_to"})
    values.update(
        datasets=datasets,
        eval_prompts=eval_prompts,
        init_from=init_from,
        chat_template=chat_template,
        output_dir=str(output_dir),
        # re-checked when the engine reads and writes: the builtin datasets live in the data dir
        dataset_roots=[str(r) for r in [*dataset_roots, (data_dir / "defaults").resolve()]],
        output_roots=[str(r) for r in output_roots],
        adam_betas=tuple(spec.adam_betas),
    )
    if spec.loss is not None:
        from dflash_core.step.objective_spec import parse_loss

        values["loss"] = parse_loss(spec.loss)
    return TrainJob(**values)


def _job_datasets(datasets: list[str], job_outputs: Any) -> dict[int, Path]:
    """{index: output directory} of the datasets named job://<id>."""
    from .regenerate_spec import JOB_SCHEME, resolve_job_dataset

    out = {}
    for i, raw in enumerate(datasets):
        if raw.startswith(JOB_SCHEME):
            if job_outputs is None:
                raise SpecError(f"datasets[{i}]", "job:// datasets are resolved by the daemon")
            out[i] = resolve_job_dataset(raw, f"datasets[{i}]", job_outputs).resolve()
    return out


def given_paths(spec: Mapping[str, Any], train_job, job_id: str) -> dict[str, str]:
    """Each path of a job as the engine has it (resolved) -> as the client gave it in `spec` (the
    stored spec); the default output_dir as its documented form."""
    pairs = dict(zip(train_job.datasets, spec.get("datasets") or [], strict=False))
    for key in ("eval_prompts", "chat_template", "init_from"):
        resolved, given = getattr(train_job, key, None), spec.get(key)
        if resolved and given:
            pairs[resolved] = given
    pairs[train_job.output_dir] = spec.get("output_dir") or f"<data_dir>/jobs/{job_id}"
    return pairs


def name_as_given(text: str, paths: Mapping[str, str]) -> str:
    """`text` with every path of `paths` (resolved -> given) that stands in it as a whole path, or
    as the directory part of one (a file found in a directory entry), named as given. Job errors
    and events are shown to whoever may read the jobs: they must not tell where the daemon's
    roots lie or where a symlink leads."""
    known = {resolved.rstrip("/") or resolved: given for resolved, given in paths.items() if resolved}
    if not known:
        return text
    alternatives = "|".join(re.escape(p) for p in sorted(known, key=len, reverse=True))
    # a path starts where no path character precedes it and ends at a separator or a non-path character
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])")

    def given(match: re.Match[str]) -> str:
        name = known[match.group(1)]
        # "shards/" + "/shard.jsonl": one separator
        return (name.rstrip("/") or name) if text.startswith("/", match.end()) else name

    return pattern.sub(given, text)


def train_job_to_json(job) -> str:
    return json.dumps(asdict(job))


def train_job_from_json(text: str):
    """Rebuild a stored TrainJob; keys the engine no longer knows are dropped."""
    from dflash_core.engine import TrainJob

    data = json.loads(text)
    if data.get("kind") == "regenerate":
        from dflash_core.regenerate.job import RegenerateJob

        return RegenerateJob.from_dict(data)
    known = {f.name for f in fields(TrainJob)}
    values = {k: v for k, v in data.items() if k in known}
    if "adam_betas" in values:
        values["adam_betas"] = tuple(values["adam_betas"])
    return TrainJob(**values)
