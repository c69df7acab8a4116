"""Job kinds besides training: each kind is a run class the engine hands its jobs to, so the
training loop in engine.py stays the one thing it runs itself. A job names its kind in a `kind`
attribute; a TrainJob has none (training is the default kind)."""

from __future__ import annotations

from typing import Any

from .api import JobError


def run_class(job: Any) -> type | None:
    """The run class of a job of another kind than training, None for a training job."""
    kind = getattr(job, "kind", "train")
    if kind == "train":
        return None
    if kind == "regenerate":
        from ..regenerate.run import RegenerationRun

        return RegenerationRun
    raise JobError(f"unknown job kind {kind!r}", "kind")
