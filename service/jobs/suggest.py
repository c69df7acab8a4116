"""A "did you mean" for an unknown job field: the field of the spec it is most likely a typo or a
synonym of. Names other trainers use for the same setting (`lr`, `max_steps`, `save_steps`, ...)
map to ours; anything else is matched by spelling."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# names users bring from other trainers (HF Trainer, SpecForge, torchtune) -> our field
SYNONYMS = {
    "lr": "learning_rate",
    "learning-rate": "learning_rate",
    "max_steps": "steps",
    "num_steps": "steps",
    "train_steps": "steps",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "dataset": "datasets",
    "data": "datasets",
    "train_data": "datasets",
    "data_path": "datasets",
    "output": "output_dir",
    "output_path": "output_dir",
    "save_steps": "checkpoint_interval",
    "save_interval": "checkpoint_interval",
    "save_total_limit": "keep_checkpoints",
    "warmup": "warmup_ratio",
    "warmup_steps": "warmup_ratio",
    "wd": "weight_decay",
    "max_grad_norm": "grad_clip",
    "clip_grad": "grad_clip",
    "gradient_accumulation_steps": "grad_accum",
    "betas": "adam_betas",
    "gamma": "loss_gamma",
    "dtype": "export_dtype",
    "resume_from": "init_from",
    "max_length": "seq_len",
    "max_seq_len": "seq_len",
    "seq_length": "seq_len",
    "eval_steps": "eval_interval",
    "eval_data": "eval_prompts",
    "min_lr": "min_lr_ratio",
    "trackers": "report_to",
}


def did_you_mean(name: str, fields: Iterable[str]) -> str | None:
    """The known field `name` most likely means, or None."""
    known = list(fields)
    key = name.strip().lower().replace("-", "_")
    for form in (key, key + "s", key.removesuffix("s")):  # plural or singular of the same name
        if form in known:
            return form
        if SYNONYMS.get(form) in known:
            return SYNONYMS[form]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if close:
        return close[0]
    # a name that is a part of one field only: "anchors" -> num_anchors
    parts = [f for f in known if key in f.split("_") or f in key.split("_")]
    return parts[0] if len(parts) == 1 else None


def unknown_field_message(name: str, fields: Iterable[str], kind: str | None = None) -> str:
    """kind: the job kind whose spec has this field, if another kind's has it."""
    if kind is not None:
        return f'unknown field (not part of this kind of job); it belongs to "kind": "{kind}" jobs'
    hint = did_you_mean(name, fields)
    return "unknown field (not part of the job spec)" + (f"; did you mean '{hint}'?" if hint else "")
