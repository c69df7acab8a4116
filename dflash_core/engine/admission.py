"""Admission of a training job: everything that can be checked before it runs, in one place.

The service calls it (through `Engine.validate_job`) before it queues a job, and the engine
again when the job starts: a refusal names the job spec field at fault (the service answers
422). Before the engine is built only the shapes and settings are checked, so jobs can be
queued while it warms; once built, also the checkpoint to start from, the chat template and
the output directory.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from ..checkpoint import read_config
from ..config import DrafterConfig
from ..confine import OutsideRoots
from .api import JobError
from .checkpointing import checkpoint_size, human_bytes
from .config import EngineConfig, TrainJob, job_template
from .objective import check_objective
from .warmup import Parts


def admit_training(job: TrainJob, config: EngineConfig, parts: Parts | None) -> None:
    """Raise JobError(message, field) for a job this engine cannot run as warmed (parts: the
    built engine's, None while it builds)."""
    check_shapes(job, config)
    check_objective(job, config.teacher, config.recipe)
    if job.steps is not None and job.steps < 1:
        raise JobError("must be at least 1", "steps")
    if job.steps is None and job.epochs is None:
        raise JobError("give steps or epochs", "steps")
    if parts is None:  # checked again when the job starts
        return
    check_init_from(job, parts)
    check_template(job, parts)
    check_output(job, parts)


def check_shapes(job: TrainJob, config: EngineConfig) -> None:
    shape = config.shape
    for name, want in (
        ("seq_len", shape.seq_len),
        ("num_anchors", shape.num_anchors),
        ("block_size", shape.block_size),
    ):
        got = getattr(job, name)
        if got is not None and got != want:
            raise JobError(
                f"{got} differs from the warmed engine's {name}={want}; the engine compiled for "
                f"seq_len={shape.seq_len}, num_anchors={shape.num_anchors}, "
                f"block_size={shape.block_size} and does not recompile at runtime",
                name,
            )


# what a backbone checkpoint of a recipe without heads may differ in from the drafter it starts
# (ModelOpt warm-starts DSpark from DFlash so): the heads start fresh, and the block size and
# layout are a matter of inputs and labels, not of weights
_BACKBONE_FREE = ("recipe", "markov_rank", "markov_head_type", "layout", "block_size")


def check_init_from(job: TrainJob, parts: Parts) -> None:
    """The checkpoint to start from has the engine's drafter architecture, or is the backbone of
    it (a DFlash checkpoint for a DSpark drafter: backbone loaded, heads fresh)."""
    if not job.init_from:
        return
    try:
        other = read_config(job.init_from)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise JobError(str(e), "init_from") from None
    mine = parts.drafter_config
    if other == mine:
        return
    diff = [f.name for f in fields(DrafterConfig) if f.compare and getattr(other, f.name) != getattr(mine, f.name)]
    backbone = not other.recipe_spec.heads and mine.recipe_spec.heads
    rest = [k for k in diff if not (backbone and k in _BACKBONE_FREE)]
    if rest:
        shown = ", ".join(f"{k} {getattr(other, k)!r} (the engine's {getattr(mine, k)!r})" for k in rest[:4])
        raise JobError(f"the checkpoint's drafter differs from the engine's in {shown}", "init_from")


def check_resume(checkpoint: str, mine: DrafterConfig) -> None:
    """A resume continues the drafter its checkpoint holds: the same architecture, block size and
    layout as the engine's (an engine restarted with another `[engine] layout` would otherwise
    train the saved weights on labels of the other layout). A checkpoint without a config is the
    loader's to refuse."""
    if not (Path(checkpoint) / "config.json").is_file():
        return
    try:
        saved = read_config(checkpoint)
    except (ValueError, KeyError) as e:
        raise JobError(f"{checkpoint}: {e}", "output_dir") from None
    diff = [f.name for f in fields(DrafterConfig) if f.compare and getattr(saved, f.name) != getattr(mine, f.name)]
    if diff:
        shown = ", ".join(f"{k} {getattr(saved, k)!r} (the engine's {getattr(mine, k)!r})" for k in diff[:4])
        raise JobError(
            f"{checkpoint}: cannot resume: the checkpoint's drafter differs from the engine's in {shown}; "
            "start a new job (init_from starts from these weights where the architecture allows)",
            "output_dir",
        )


def check_template(job: TrainJob, parts: Parts) -> None:
    """Render a small conversation with the job's template and options, so that a template
    that cannot render (or an option it rejects) is refused before the job is queued."""
    field = "chat_template" if job.chat_template else "chat_template_kwargs"
    try:
        template = job_template(job)
    except OutsideRoots as e:
        raise JobError(str(e), "chat_template") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"cannot read the template: {e}", "chat_template") from None
    probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    try:
        text = template.probe(parts.tokenizer, probe, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - any template failure is the user's to fix
        raise JobError(f"the chat template cannot render a conversation: {type(e).__name__}: {e}", field) from None
    if "pong" not in text:
        raise JobError("the chat template does not render the assistant's message", field)


def check_output(job: TrainJob, parts: Parts) -> None:
    """The output directory can take a checkpoint: writable, and room for one on its file
    system (checked again before each checkpoint), so that a read-only or full disk is a
    refusal at submission rather than a failure after hours of training."""
    path = Path(job.output_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not os.access(existing, os.W_OK):
        raise JobError(f"{job.output_dir!r} cannot be written (read-only file system or no permission)", "output_dir")
    st = os.statvfs(existing)
    free, need = st.f_bavail * st.f_frsize, checkpoint_size(parts.replicas[0], job.export_dtype)
    if free < need:
        raise JobError(
            f"{job.output_dir!r}: {human_bytes(free)} free on its file system, a checkpoint needs about "
            f"{human_bytes(need)} (ENOSPC)",
            "output_dir",
        )
