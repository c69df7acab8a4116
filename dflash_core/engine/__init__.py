"""The engine: build and status (engine), sequential warm-up (warmup), job admission
(admission), the run protocol of the job kinds (kinds) and what a run sees of the engine
(context; the runs themselves are dflash_core.train, .regenerate and .continual), the rank
protocol (ranks, over distributed), the feature pipeline (pipeline), the drafter threads and
gradient averaging (drafters), one drafter replica (replica) and its step graph (step_graph),
checkpoints (checkpointing), compile handling (compile) and the optimizer (optim).

Names are imported lazily: `from dflash_core.engine.config import EngineConfig` must stay cheap
(the daemon validates its config before it imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": ".engine",
    "EngineConfig": ".config",
    "TrainJob": ".config",
    "EngineStatus": ".api",
    "JobCallbacks": ".api",
    "JobError": ".api",
    "JobResult": ".api",
    "StepStats": ".api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
