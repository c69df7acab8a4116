"""Engine: build + sequential warmup, worker threads, gradient sync, job runner."""
from .config import EngineConfig, TrainJob
from .engine import Engine, JobCallbacks, JobFailed, JobResult, JobValidationError, Progress, StepStats

__all__ = ["Engine", "EngineConfig", "JobCallbacks", "JobFailed", "JobResult", "JobValidationError", "Progress", "StepStats", "TrainJob"]
