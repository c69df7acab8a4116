"""The README's job-spec table, generated from the schema (`python -m service.jobs.spec_table`),
so that it lists every field with its type and default as POST /jobs validates them;
tests/test_readme.py fails when the README's copy differs."""

from __future__ import annotations

import json
from typing import Any

from .schemas import JobSpec

# what a field means, for the fields whose schema carries no description
MEANING = {
    "name": "a label shown by `status` and the API",
    "steps": "optimizer steps to train (give `steps` or `epochs`)",
    "epochs": "passes over the datasets (give `steps` or `epochs`)",
    "learning_rate": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine decay ends at `learning_rate` times this",
    "warmup_ratio": "fraction of the steps spent ramping the learning rate up",
    "weight_decay": "AdamW weight decay",
    "adam_betas": "AdamW's two betas, each in [0, 1)",
    "grad_accum": "micro-batches per optimizer step on each drafter replica",
    "seed": "seed of the weights' init and the data order",
    "checkpoint_interval": "steps between checkpoints (the last step always checkpoints)",
    "keep_checkpoints": "how many of the newest checkpoints are kept",
    "skip_bad_lines": "skip (and report) malformed dataset lines instead of failing the job",
    "eval_fraction": "fraction of the datasets' conversations held out for acceptance length",
    "eval_interval": "steps between acceptance-length evaluations (0: only at the end)",
    "eval_max_prompts": "held-out prompts per evaluation",
    "eval_max_new_tokens": "tokens generated per held-out prompt",
    "seq_len": "tokens per micro-batch; must equal the warmed engine's",
    "num_anchors": "blocks per micro-batch; must equal the warmed engine's",
    "block_size": "block size; must equal the warmed engine's",
}


def _type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " \\| ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        kinds = [_type(s) for s in schema["anyOf"]]
        return " or ".join(k for k in kinds if k != "null") + (" or null" if "null" in kinds else "")
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    return {"object": "object", "string": "string", "integer": "integer", "number": "number"}.get(kind, kind)


def _default(name: str) -> str:
    field = JobSpec.model_fields[name]
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "-" if value is None else f"`{json.dumps(value)}`"


def spec_table() -> str:
    """The markdown table: field, type, default, meaning; one row per JobSpec field, in order."""
    props = JobSpec.model_json_schema()["properties"]
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in JobSpec.model_fields.items():
        meaning = field.description or MEANING.get(name)
        if not meaning:
            raise ValueError(f"job field {name!r} has no description and no entry in MEANING")
        meaning = meaning.replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(props[name])} | {_default(name)} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(spec_table())
