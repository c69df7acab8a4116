"""The job kinds table: every kind's parts resolve, a stored job comes back as its kind's
dataclass, and an unknown kind is refused by name where it is looked up."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_core import kinds
from dflash_core.engine.api import JobError
from dflash_core.engine.kinds import run_class


def test_every_kind_resolves_its_parts():
    assert kinds.names()[0] == kinds.DEFAULT_KIND
    for entry in kinds.KINDS:
        job_type = entry.job_type()
        assert dataclasses.is_dataclass(job_type)
        for method in ("validate", "admit", "execute"):
            assert callable(getattr(entry.run_type(), method))
        assert callable(entry.converter())
        model = entry.spec_model()
        assert ("kind" in model.model_fields) == (entry.name != kinds.DEFAULT_KIND)


def test_a_job_round_trips_as_its_kind():
    from dflash_core.engine.config import TrainJob
    from dflash_core.regenerate.job import RegenerateJob

    train = TrainJob(datasets=["a"], output_dir="/o", steps=3)
    regen = RegenerateJob(datasets=["a"], output_dir="/o")
    assert kinds.job_from_dict(train.to_dict()) == train
    assert kinds.job_from_dict(regen.to_dict()) == regen
    assert kinds.kind_of(train).name == "train" and kinds.kind_of(regen).name == "regenerate"


def test_unknown_and_one_host_kinds_are_refused_by_name():
    with pytest.raises(kinds.UnknownKind, match="the job kinds are"):
        kinds.kind("distill")

    class Odd:
        kind = "distill"

    with pytest.raises(JobError) as e:
        run_class(Odd())
    assert e.value.field == "kind"
    from dflash_core.regenerate.job import RegenerateJob

    with pytest.raises(JobError, match="one host"):
        run_class(RegenerateJob(datasets=["a"], output_dir="/o"), multi_host=True)
    assert run_class(RegenerateJob(datasets=["a"], output_dir="/o")).__name__ == "RegenerationRun"
