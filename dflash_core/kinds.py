"""The job kinds, in one table: each kind names its engine job (a dataclass with `to_dict` and
`from_dict`), its run (the protocol of engine/kinds.py), the service's spec model for it, the
service's conversion of that spec into the engine job, and whether it runs on a multi-host group.

Everything that dispatches on a kind looks it up here: the service's spec parsing and its
spec -> job conversion, the store's decoding of a stored job, the engine's choice of run and the
group ranks' `follow`. Adding a kind is a folder in dflash_core with its job and its run (which
takes the job's RunContext, engine/context.py), its spec and conversion in a service/jobs module,
and one line below.

Entries name their parts as "module:attribute" and are imported when first asked for, so that
reading the table imports neither torch nor the web stack: the engine resolves only the job and
run of a kind, the service also its spec and conversion (this package never imports the service).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

DEFAULT_KIND = "train"


@dataclass(frozen=True)
class JobKind:
    name: str
    job: str  # the engine's job dataclass
    run: str  # the run class (engine/kinds.py: JobRun)
    spec: str  # the service's pydantic spec model
    convert: str  # the service's (spec, job_id, roots, job_outputs) -> engine job
    multi_host: bool  # a multi-host group's ranks can run it together
    # it reports training scalars (loss, learning rate, ...) for the experiment trackers
    trains: bool = True
    # it resumes from what its output directory holds (a regeneration's shards), a checkpoint or not
    resumes_from_output: bool = False

    def job_type(self) -> Any:
        return resolve(self.job)

    def run_type(self) -> Any:
        return resolve(self.run)

    def spec_model(self) -> Any:
        return resolve(self.spec)

    def converter(self) -> Any:
        return resolve(self.convert)


KINDS: tuple[JobKind, ...] = (
    JobKind(
        "train",
        "dflash_core.engine.config:TrainJob",
        "dflash_core.train.run:TrainRun",
        "service.jobs.schemas:JobSpec",
        "service.jobs.admission:train_job",
        True,
    ),
    JobKind(
        "regenerate",
        "dflash_core.regenerate.job:RegenerateJob",
        "dflash_core.regenerate.run:RegenerationRun",
        "service.jobs.regenerate_spec:RegenerateSpec",
        "service.jobs.admission:regenerate_job",
        False,
        trains=False,
        resumes_from_output=True,
    ),
    JobKind(
        "continual",
        "dflash_core.continual.job:ContinualJob",
        "dflash_core.continual.run:ContinualRun",
        "service.jobs.continual_spec:ContinualSpec",
        "service.jobs.continual_spec:continual_job",
        False,
    ),
)

_BY_NAME = {k.name: k for k in KINDS}
if len(_BY_NAME) != len(KINDS):  # a name listed twice would shadow the first silently
    raise RuntimeError("a job kind is listed twice in dflash_core.kinds.KINDS")


class UnknownKind(KeyError):
    def __init__(self, name: object):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"{self.name!r}: the job kinds are {', '.join(repr(k) for k in names())}"


def names() -> list[str]:
    return [k.name for k in KINDS]


def kind(name: object) -> JobKind:
    """The kind of this name; UnknownKind for any other."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnknownKind(name)
    return found


def kind_of(job: Any) -> JobKind:
    """The kind of an engine job (one without a `kind` attribute is a training job)."""
    return kind(getattr(job, "kind", DEFAULT_KIND))


def kind_of_spec(spec: dict[str, Any]) -> JobKind:
    """The kind of a job spec as sent or stored (one without `kind` is a training job's)."""
    return kind(spec.get("kind", DEFAULT_KIND))


def job_from_dict(values: dict[str, Any]) -> Any:
    """A stored or sent engine job, rebuilt as its kind's dataclass."""
    return kind(values.get("kind", DEFAULT_KIND)).job_type().from_dict(values)


@functools.cache
def resolve(ref: str) -> Any:
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)
