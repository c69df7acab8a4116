"""The engine: build and sequential warm-up (warmup), the feature pipeline (pipeline), the job
loop (engine), checkpoints (checkpointing), compile handling (compile), one drafter replica
(replica), gradient averaging (grad_sync) and the optimizer (optim).

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
