"""The spec of a continual job (POST /jobs with "kind": "continual"): every training field, plus
where its records come from and where and when it publishes; `continual_job` turns it into the
engine's ContinualJob, every path checked against the roots as a training job's.

A continual job runs until it is cancelled, so it takes neither `steps` nor `epochs`; `datasets`
are optional initial data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .admission import JobOutputs, train_values
from .paths import Roots
from .schemas import JobSpec, SpecError, _document_checks, check_training_fields

DEFAULT_PUBLISH_DIR = "published"  # under the job's output_dir


class AnswerSpec(BaseModel):
    """How the target answers a continual job's prompt-only records (unknown fields refused)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=1, le=10**6, description="new tokens per answer at most")
    temperature: float = Field(0.0, ge=0, le=100, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=10**7, description="0: no top-k filter")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="each prompt's seed is derived from it and its arrival")
    slots: int = Field(8, ge=1, le=4096, description="prompts answered at once (the decoder's cache, allocated once)")


class ContinualSpec(JobSpec):
    """A training job without an end, on records that arrive while it runs."""

    model_config = ConfigDict(json_schema_extra=lambda schema, cls: _document_checks(schema))

    kind: Literal["continual"]
    datasets: list[str] = Field(
        default_factory=list, max_length=1024, description="initial data, trained first (any training dataset)"
    )
    sources: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="directories under the dataset roots watched for new files and appended lines (any layout "
        "a training job reads)",
    )
    replay_ratio: float = Field(
        0.5, ge=0, lt=1, description="share of each micro-batch drawn from older records (below 1: new ones train)"
    )
    publish_dir: str | None = Field(None, description="under the output roots; default <output_dir>/published")
    publish_every_steps: int = Field(100, ge=1, le=10**9, description="steps between publish evaluations")
    publish_margin: float = Field(
        0.0, ge=0, le=100, description="relative acceptance-length gain over the published drafter needed to publish"
    )
    keep_versions: int = Field(5, ge=1, le=10_000, description="published versions kept")
    target_watch: str | None = Field(None, description="a directory where new target versions appear")
    reload_url: str | None = Field(
        None, max_length=2048, description="POSTed {model_path, version, tau, step} after each publish"
    )
    regenerate: AnswerSpec | None = Field(None, description="sampling settings: the target answers prompt-only records")
    yield_to_queue: bool = Field(True, description="give the devices to a queued job at the next checkpoint")
    poll_seconds: float = Field(1.0, ge=0.05, le=3600, description="how often the sources are looked at")
    max_pending_records: int = Field(
        100_000, ge=1, le=10**8, description="records accepted but not yet trained at most (then 429)"
    )
    replay_records: int = Field(20_000, ge=1, le=10**7, description="older records kept for replay")
    heldout_every: int = Field(
        # 1 would hold out every record and train on none
        8,
        ge=2,
        le=10**6,
        description="every n-th new record is held out for the publish evaluation",
    )

    @model_validator(mode="after")
    def _checks(self) -> ContinualSpec:  # replaces the training spec's: no steps or epochs here
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None:
                raise SpecError(name, "a continual job runs until it is cancelled; it takes no steps or epochs")
        if self.reload_url is not None:
            url = urlsplit(self.reload_url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise SpecError("reload_url", "an http:// or https:// URL with a host")
            if "@" in url.netloc:  # stored and shown with the job: a secret here would be readable by every reader
                raise SpecError(
                    "reload_url", "a URL without credentials (user:password@): the job's spec is shown to readers"
                )
        duplicates = sorted({s for s in self.sources if self.sources.count(s) > 1})
        if duplicates:
            raise SpecError("sources", f"listed more than once: {', '.join(duplicates)}")
        check_training_fields(self)
        return self


def _sources_apart(spec: ContinualSpec, sources: list[str], roots: Roots, written: list[Path]) -> None:
    """A source is read whole, every file below it, at every poll: one that is the data directory
    or holds it would read the daemon's own files (its held-out set, other jobs' outputs), and one
    that holds the job's output or publish directory, or lies in it, would read what the job
    writes (its checkpoints, its ingested records) as new records."""
    data_dir = roots.data_dir.resolve()
    for i, (raw, source) in enumerate(zip(spec.sources, sources, strict=True)):
        path = Path(source)
        if data_dir == path or data_dir.is_relative_to(path):
            raise SpecError(
                f"sources[{i}]", f"{raw!r} is the daemon's data directory or holds it; give a directory in it"
            )
        for out in written:
            if out == path or out.is_relative_to(path) or path.is_relative_to(out):
                raise SpecError(
                    f"sources[{i}]",
                    f"{raw!r} and the job's output or publish directory lie one inside the other: the job would "
                    "read what it writes",
                )


def continual_job(spec: ContinualSpec, job_id: str, roots: Roots, job_outputs: JobOutputs | None = None):
    from dflash_core.continual.job import ContinualJob
    from dflash_core.continual.sources import source_problem

    values = train_values(spec, job_id, roots, job_outputs)
    sources = []
    for i, raw in enumerate(spec.sources):
        field_name = f"sources[{i}]"
        path = roots.resolve(raw, field_name, roots.reads)
        try:
            problem = source_problem(str(path), [str(r) for r in roots.reads], [str(r) for r in roots.writes])
            if problem is not None:
                raise SpecError(field_name, f"{raw!r}: {problem}")
        except OSError as e:
            raise SpecError(field_name, f"{raw[:200]!r} cannot be read ({e.strerror or type(e).__name__})") from None
        sources.append(str(path))
    if spec.publish_dir is None:
        publish_dir = f"{values['output_dir']}/{DEFAULT_PUBLISH_DIR}"
    else:
        publish = roots.resolve(spec.publish_dir, "publish_dir", roots.writes)
        if publish.exists() and not publish.is_dir():
            raise SpecError("publish_dir", f"{spec.publish_dir!r} exists and is not a directory")
        publish_dir = str(publish)
    target_watch = None
    if spec.target_watch is not None:
        watch = roots.resolve(spec.target_watch, "target_watch", roots.reads)
        if not watch.is_dir():
            raise SpecError("target_watch", f"{spec.target_watch!r} is not a directory (target versions appear in it)")
        target_watch = str(watch)
    _sources_apart(spec, sources, roots, [Path(values["output_dir"]), Path(publish_dir)])
    values.update(
        sources=sources,
        publish_dir=publish_dir,
        target_watch=target_watch,
        steps=None,
        epochs=None,
    )
    return ContinualJob(**values)
