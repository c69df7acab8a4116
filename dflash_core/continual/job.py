"""A continual job: a training job (every training field applies) that runs until it is
cancelled, on the records its sources and its ingest spool bring, and publishes versions of the
drafter (the service validates and fills this, as it does a TrainJob)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.config import TrainJob

KIND = "continual"
# the step count a continual job runs to: it has no end but a cancel (or a yield to the queue)
ENDLESS_STEPS = 10**12
SPOOL_DIR = "records"  # under output_dir: what POST /jobs/{id}/records accepted, as NDJSON files
SPOOL_PREFIX = "ingested-"  # ingested-000001.jsonl, ...: a new file once the current one is this large
SPOOL_FILE_BYTES = 64 << 20
STATE_FILE = "continual-state.json"  # under output_dir: how far each source was read at a checkpoint


@dataclass
class ContinualJob(TrainJob):
    kind: str = KIND
    sources: list[str] = field(default_factory=list)  # directories watched for new files and lines
    replay_ratio: float = 0.5  # share of each micro-batch's tokens drawn from older records
    publish_dir: str = ""
    publish_every_steps: int = 100
    publish_margin: float = 0.0  # relative acceptance-length gain a candidate needs over the published
    keep_versions: int = 5
    target_watch: str | None = None
    reload_url: str | None = None
    regenerate: dict[str, Any] | None = None  # sampling settings for prompt-only records
    yield_to_queue: bool = True
    poll_seconds: float = 1.0  # how often the sources are looked at
    max_pending_records: int = 100_000  # records accepted but not yet trained (the ingest bound)
    replay_records: int = 20_000  # older records kept for replay
    heldout_every: int = 8  # every n-th new record is held out for the publish evaluation

    def spool_dir(self) -> Path:
        return Path(self.output_dir) / SPOOL_DIR

    def state_path(self) -> Path:
        return Path(self.output_dir) / STATE_FILE


def spool_name(number: int) -> str:
    return f"{SPOOL_PREFIX}{number:06d}.jsonl"


def spool_number(name: str) -> int | None:
    """The number of a spool file's name (ingested-000012.jsonl -> 12), None for other names."""
    digits = name.removeprefix(SPOOL_PREFIX).removesuffix(".jsonl")
    if not (name.startswith(SPOOL_PREFIX) and name.endswith(".jsonl") and digits.isascii() and digits.isdigit()):
        return None
    return int(digits)
