"""What a run sees of the engine (`RunContext`): the built parts, the rank protocol, the drafter
threads, the settings and the meters, handed to every run class (the protocol of kinds.py) in
place of the engine itself. A run reads the engine only through it and writes nothing to it
but the live feature pipeline (`LivePipeline`), which the engine's status reads; so a run
module imports neither the engine nor anything that imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.prepare import Tokenization
from ..telemetry import RateMeter
from .config import EngineConfig
from .drafters import Drafters
from .pipeline import FeaturePipeline
from .ranks import Ranks
from .warmup import Parts, PartsView, Timeline


class LivePipeline:
    """The running job's feature pipeline, for the engine's status (its queue depths): shown by
    the run when it starts one, cleared when it closes it; None between jobs."""

    def __init__(self) -> None:
        self.pipeline: FeaturePipeline | None = None

    def show(self, pipeline: FeaturePipeline) -> FeaturePipeline:
        self.pipeline = pipeline
        return pipeline

    def clear(self) -> None:
        self.pipeline = None

    def depths(self) -> dict[str, int]:
        pipeline = self.pipeline  # read once: the job's thread may clear it meanwhile
        return pipeline.depths() if pipeline is not None else {}


@dataclass(frozen=True)
class RunContext(PartsView):
    """One job's view of the engine, built by the engine for that job (its validation too,
    which may come before the engine is built: then `parts` is None)."""

    config: EngineConfig
    data_dir: Path
    parts: Parts | None  # None until the engine is built
    ranks: Ranks
    drafters: Drafters
    timeline: Timeline
    rate: RateMeter  # the engine's tokens per second, which a training run feeds
    # what a job's tokenized cache entries depend on (Engine.tokenization)
    tokenization: Callable[[Any], Tokenization]
    live: LivePipeline
    multi_host: bool  # the run is shared by the ranks of a multi-host group
