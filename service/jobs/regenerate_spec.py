"""The spec of a regeneration job (POST /jobs with "kind": "regenerate") and its translation into
the engine's RegenerateJob, every path checked against the configured roots as a training job's.

A training job names a regeneration's output as a dataset by its output directory or as
`job://<id>` (resolve_job_dataset)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .schemas import (
    MAX_TEMPLATE_KWARGS_BYTES,
    SpecError,
    canonical_json,
    resolve_dataset,
    resolve_output_dir,
    resolve_template,
)

JOB_SCHEME = "job://"


class RegenerateSpec(BaseModel):
    """The target answers the datasets' prompts; the answers become a dataset. Unknown fields
    (a sampling option this daemon does not have) are refused, never ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_strip_whitespace=True, strict=True)

    kind: Literal["regenerate"]
    name: str | None = Field(None, max_length=200)
    submission_id: str | None = Field(None, min_length=1, max_length=200)
    datasets: list[str] = Field(
        min_length=1,
        max_length=1024,
        description="prompt datasets (any layout a training job reads): each conversation up to its last user "
        "turn, or a `prompt` column",
    )
    max_new_tokens: int = Field(256, ge=1, le=10**6, description="new tokens per answer at most")
    temperature: float = Field(0.0, ge=0, le=100, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=10**7, description="0: no top-k filter")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="each (prompt, sample) gets its own seed derived from it")
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    chat_template: str | None = Field(None, description="a Jinja chat template file; default: the tokenizer's")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='options the chat template reads, e.g. {"enable_thinking": false}'
    )
    skip_bad_lines: bool = False
    output_dir: str | None = Field(None, description="default <data_dir>/jobs/<job id>")
    shard_rows: int = Field(1024, ge=1, le=10**7, description="rows per parquet shard (the unit of resume)")

    @model_validator(mode="after")
    def _checks(self) -> RegenerateSpec:
        if len(canonical_json(self.chat_template_kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise SpecError("chat_template_kwargs", f"larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        duplicates = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if duplicates:
            raise SpecError("datasets", f"listed more than once: {', '.join(duplicates)}")
        return self

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode()).hexdigest()


def check_prompts_readable(path: Path, field_name: str, *, skip_bad_lines: bool, given: str, roots: list[Path]) -> None:
    """The dataset holds at least one prompt, and its records up to the first one read: what
    cannot be read is refused at submission rather than failing the job later."""
    from dflash_core.confine import OutsideRoots
    from dflash_core.data.conversations import DatasetError
    from dflash_core.data.prompts import read_prompts

    try:
        if next(read_prompts(path, skip_bad_lines=skip_bad_lines, name=given, roots=roots), None) is None:
            raise SpecError(field_name, f"dataset {given!r} holds no prompts")
    except (DatasetError, OutsideRoots) as e:
        raise SpecError(field_name, str(e)) from None
    except OSError as e:
        raise SpecError(field_name, f"the dataset cannot be read ({e.strerror or type(e).__name__})") from None


def to_regenerate_job(
    spec: RegenerateSpec, *, job_id: str, data_dir: Path, dataset_roots: list[Path], output_roots: list[Path]
):
    from dflash_core.regenerate.job import RegenerateJob

    resolved = [
        resolve_dataset(d, f"datasets[{i}]", roots=dataset_roots, data_dir=data_dir)
        for i, d in enumerate(spec.datasets)
    ]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise SpecError(f"datasets[{i}]", f"the same dataset as datasets[{resolved.index(path)}]")
        check_prompts_readable(
            path, f"datasets[{i}]", skip_bad_lines=spec.skip_bad_lines, given=spec.datasets[i], roots=dataset_roots
        )
    chat_template = None
    if spec.chat_template is not None:
        chat_template = str(resolve_template(spec.chat_template, roots=dataset_roots, data_dir=data_dir))
    output_dir = resolve_output_dir(spec.output_dir, roots=output_roots, data_dir=data_dir, job_id=job_id)
    values = spec.model_dump(exclude={"name", "submission_id"})
    values.update(
        datasets=[str(p) for p in resolved],
        chat_template=chat_template,
        output_dir=str(output_dir),
        dataset_roots=[str(r) for r in [*dataset_roots, (data_dir / "defaults").resolve()]],
        output_roots=[str(r) for r in output_roots],
    )
    return RegenerateJob(**values)


def resolve_job_dataset(raw: str, field_name: str, output_of: Callable[[str], tuple[str, str, str] | None]) -> Path:
    """job://<id> -> that regeneration job's output directory; output_of(id) gives (kind, state,
    output_dir) of a stored job, None for an unknown one. The job must have SUCCEEDED."""
    job_id = raw[len(JOB_SCHEME) :].strip("/")
    found = output_of(job_id)
    if found is None:
        raise SpecError(field_name, f"{raw!r}: no job {job_id!r}")
    kind, state, output_dir = found
    if kind != "regenerate":
        raise SpecError(field_name, f"{raw!r} is a {kind} job; only a regeneration's output is a dataset")
    if state != "SUCCEEDED":
        raise SpecError(field_name, f"{raw!r} is {state}; its output is a dataset once it SUCCEEDED")
    return Path(output_dir)
