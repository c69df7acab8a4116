"""A validated spec becomes the engine's job: every path resolved and checked against the roots,
every dataset read far enough to refuse at submission what the job could not read later.

Each kind's conversion is named in the kinds table (dflash_core/kinds.py) and reached through it by
service.jobs.by_kind.to_engine_job; the engine's job (a
TrainJob, a RegenerateJob, ...) is the one shape a job has from here on: the store keeps it as the JSON of its own `to_dict`, and the worker rebuilds
it with `job_from_json` to run it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_core.confine import under
from dflash_core.kinds import UnknownKind, job_from_dict

from .paths import Roots, check_dataset_readable, unique_datasets
from .regenerate_spec import JOB_SCHEME, RegenerateSpec, check_prompts_readable, resolve_job_dataset
from .schemas import JobSpec, SpecError

# job id -> (kind, state, output_dir) of a stored job, None for an unknown one (job:// datasets)
JobOutputs = Callable[[str], tuple[str, str, str] | None]


def train_job(spec: JobSpec, job_id: str, roots: Roots, job_outputs: JobOutputs | None = None):
    from dflash_core.engine import TrainJob

    return TrainJob(**train_values(spec, job_id, roots, job_outputs))


def train_values(spec: JobSpec, job_id: str, roots: Roots, job_outputs: JobOutputs | None) -> dict[str, Any]:
    """The training fields of an engine job for this spec (a training job's, and those every kind
    that trains shares), every path resolved and checked."""
    jobs_read = _job_datasets(spec.datasets, job_outputs, roots)
    roots = roots.reading_also(jobs_read.values())
    if spec.report_to:
        from ..tracking import unavailable

        missing = unavailable(list(spec.report_to))
        if missing:
            raise SpecError("report_to", f"{', '.join(missing)}: not installed in the daemon's environment")
    resolved = [jobs_read.get(i) or roots.dataset(d, f"datasets[{i}]") for i, d in enumerate(spec.datasets)]
    unique_datasets(resolved)
    for i, path in enumerate(resolved):
        check_dataset_readable(
            path, f"datasets[{i}]", skip_bad_lines=spec.skip_bad_lines, given=spec.datasets[i], roots=roots
        )
    values = spec.model_dump(exclude={"name", "submission_id", "report_to"})
    values.update(
        datasets=[str(p) for p in resolved],
        eval_prompts=_eval_prompts(spec, roots),
        chat_template=str(roots.template(spec.chat_template)) if spec.chat_template is not None else None,
        init_from=str(roots.checkpoint(spec.init_from)) if spec.init_from is not None else None,
        output_dir=str(roots.output_dir(spec.output_dir, job_id)),
        adam_betas=tuple(spec.adam_betas),
        **roots.for_engine(),
    )
    if spec.loss is not None:  # parsed when the spec was validated
        values["loss"] = spec.loss_mix
    return values


def _eval_prompts(spec: JobSpec, roots: Roots) -> str | None:
    if spec.eval_prompts is None:
        return None
    prompts = roots.dataset(spec.eval_prompts, "eval_prompts")
    check_dataset_readable(
        prompts, "eval_prompts", skip_bad_lines=spec.skip_bad_lines, given=spec.eval_prompts, roots=roots
    )
    return str(prompts)


def regenerate_job(spec: RegenerateSpec, job_id: str, roots: Roots, job_outputs: JobOutputs | None = None):
    from dflash_core.regenerate.job import RegenerateJob

    resolved = [roots.dataset(d, f"datasets[{i}]") for i, d in enumerate(spec.datasets)]
    unique_datasets(resolved)
    for i, path in enumerate(resolved):
        check_prompts_readable(
            path, f"datasets[{i}]", skip_bad_lines=spec.skip_bad_lines, given=spec.datasets[i], roots=list(roots.reads)
        )
    values = spec.model_dump(exclude={"name", "submission_id"})
    values.update(
        datasets=[str(p) for p in resolved],
        chat_template=str(roots.template(spec.chat_template)) if spec.chat_template is not None else None,
        output_dir=str(roots.output_dir(spec.output_dir, job_id)),
        **roots.for_engine(),
    )
    return RegenerateJob(**values)


def _job_datasets(datasets: list[str], job_outputs: JobOutputs | None, roots: Roots) -> dict[int, Path]:
    """{index: output directory} of the datasets named job://<id>. The stored directory is where
    the regeneration wrote; resolved now (symlinks followed) it must still lie under the roots,
    else it was replaced by a link since and is refused without saying where it leads."""
    out = {}
    for i, raw in enumerate(datasets):
        if raw.startswith(JOB_SCHEME):
            field_name = f"datasets[{i}]"
            if job_outputs is None:
                raise SpecError(field_name, "job:// datasets are resolved by the daemon")
            stored = resolve_job_dataset(raw, field_name, job_outputs)
            try:
                real = stored.resolve()
            except (OSError, RuntimeError):
                real = None
            if real is None or real != stored or not under(real, [*roots.reads, *roots.writes]):
                raise SpecError(
                    field_name,
                    f"{raw!r}: the job's output directory is no longer a plain directory under the roots "
                    "(it was replaced by a symlink, or the roots changed); regenerate it again",
                )
            out[i] = real
    return out


def with_roots_now(engine_job: Any, spec: dict[str, Any], roots: Roots) -> Any:
    """The stored engine job with the roots of the configuration in force now (a job runs, or
    resumes, under the roots the daemon has when it runs, not those it had at submission): its
    output_dir and every path it reads must still lie under them, else SpecError naming the field.
    The engine checks the same roots again at every read and write."""
    now = roots.for_engine()
    reads, writes = [Path(r) for r in now["dataset_roots"]], [Path(r) for r in now["output_roots"]]

    def check(path: str | None, field_name: str, given: Any, allowed: list[Path], which: str) -> None:
        # the stored paths were resolved at submission: judged as they are, the question is
        # whether the roots still hold them (a component swapped for a symlink since is refused
        # by the engine, which resolves every path again when it reads or writes)
        if path and not under(Path(os.path.abspath(path)), allowed):
            label = f"{field_name} {given!r}" if isinstance(given, str) else field_name
            raise SpecError(
                field_name,
                f"{label} is outside the daemon's {which} now (its configuration changed since the job was "
                "submitted); it does not run under this configuration",
            )

    check(engine_job.output_dir, "output_dir", spec.get("output_dir"), writes, "output_roots")
    job_dirs = []
    for i, (path, given) in enumerate(zip(engine_job.datasets, spec.get("datasets") or [], strict=False)):
        from_job = isinstance(given, str) and given.startswith(JOB_SCHEME)
        check(path, f"datasets[{i}]", given, [*reads, *writes] if from_job else reads, "roots")
        if from_job:
            job_dirs.append(path)
    for key in ("eval_prompts", "chat_template"):
        check(getattr(engine_job, key, None), key, spec.get(key), reads, "dataset_roots")
    check(getattr(engine_job, "init_from", None), "init_from", spec.get("init_from"), [*reads, *writes], "roots")
    return dataclasses.replace(
        engine_job, dataset_roots=[*now["dataset_roots"], *job_dirs], output_roots=now["output_roots"]
    )


def job_to_json(job: Any) -> str:
    """How the store keeps an engine job: its own plain-JSON form."""
    return json.dumps(job.to_dict())


def job_from_json(text: str):
    """A stored engine job, rebuilt by its kind; keys the engine no longer knows are dropped."""
    data: dict[str, Any] = json.loads(text)
    try:
        return job_from_dict(data)
    except UnknownKind as e:
        raise ValueError(f"job kind {e}") from None
