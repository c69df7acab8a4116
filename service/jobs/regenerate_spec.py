"""The spec of a regeneration job (POST /jobs with "kind": "regenerate"); service.jobs.admission
turns it into the engine's RegenerateJob, every path checked against the roots as a training job's.

A training job names a regeneration's output as a dataset by its output directory or as
`job://<id>` (resolve_job_dataset)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from .schemas import SpecError, SpecModel

JOB_SCHEME = "job://"


class RegenerateSpec(SpecModel):
    """The target answers the datasets' prompts; the answers become a dataset. Unknown fields
    (a sampling option this daemon does not have) are refused, never ignored."""

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
