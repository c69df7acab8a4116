"""A regeneration job: the target answers the datasets' prompts, and the answers become a
dataset of conversations (the service validates and fills this, as it does a TrainJob)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

KIND = "regenerate"
SHARD_ROWS = 1024  # rows per parquet shard: the unit a killed run loses and writes again


@dataclass
class RegenerateJob:
    datasets: list[str]
    output_dir: str
    kind: str = KIND
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    samples_per_prompt: int = 1
    chat_template: str | None = None  # a Jinja template file; None: the tokenizer's template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    skip_bad_lines: bool = False
    shard_rows: int = SHARD_ROWS
    # where reads and writes must stay when they happen (the service's roots; empty: unconfined)
    dataset_roots: list[str] = field(default_factory=list)
    output_roots: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RegenerateJob:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


def row_seed(job_seed: int, prompt_index: int, sample: int) -> int:
    """The seed of one (prompt, sample): fixed by the job's seed and the pair alone, so sampling
    does not depend on batching, slots or restarts."""
    digest = hashlib.blake2b(f"{job_seed}:{prompt_index}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")
