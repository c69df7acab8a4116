"""A job only succeeds if it trained: checks that stop a job FAILED, with the reason, instead of
letting it report success on garbage.

- a step whose loss or gradient norm is not finite stops the job before that step is recorded or
  checkpointed (there is no skip-and-continue policy: a non-finite step means the settings or the
  data are wrong, and every later step would be trained on the damage);
- a checkpoint whose weights are not finite is not written, so the newest checkpoint on disk (the
  one rotation keeps, and a resume reads) is always a finite one;
- a job whose data holds no token to train on, or that ran steps without training a single token,
  fails instead of succeeding with a loss of 0;
- a run whose steps had labels but whose loss was exactly 0 at every step, or whose weights ended
  bit-identical to where they started (loss weights or a learning rate so small that the update
  underflows), fails: it reported steps but trained nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .api import JobError, StepStats


def check_step(stats: StepStats) -> None:
    """Raise JobError, naming the step, when the step's loss or gradient norm is not finite."""
    if math.isfinite(stats.loss) and math.isfinite(stats.grad_norm):
        return
    raise JobError(
        f"training diverged at step {stats.step}: the loss is {stats.loss} and the gradient norm "
        f"{stats.grad_norm} (not finite); nothing of this step was checkpointed, the last checkpoint is "
        "kept. Lower learning_rate, set grad_clip, or check the data and init_from weights"
    )


def non_finite_weights(weights: dict[str, Any]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity. A tensor's sum in its own dtype finds
    them at memory speed (NaN and +-inf survive a sum); only a sum that is not finite, which
    finite values overflowing could also give, is confirmed element by element."""
    return [
        name
        for name, t in weights.items()
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and not bool(torch.isfinite(t.sum()))
        and not bool(torch.isfinite(t).all())
    ]


def check_checkpoint_weights(step: int, weights: dict[str, Any]) -> None:
    bad = non_finite_weights(weights)
    if bad:
        raise JobError(
            f"training diverged at step {step}: the weights hold non-finite values ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); the checkpoint of step {step} was not written, the last "
            "finite checkpoint is kept"
        )


def check_data_tokens(tokens: int) -> None:
    if tokens <= 0:
        raise JobError(
            "the datasets hold no token to train on (empty conversations, or every turn masked out); "
            "nothing was trained"
        )


def check_trained(
    steps: int, labels: int, *, any_loss: bool = True, any_grad: bool = True, weights_changed: bool = True
) -> None:
    """After the job's steps of this run: raise when steps ran but no position had a label (the
    loss was 0 by construction: e.g. every assistant turn empty), when the loss or the gradient
    was exactly 0 at every step (any_loss, any_grad False), or when the weights did not change
    (weights_changed False)."""
    if steps <= 0:
        return
    if labels <= 0:
        raise JobError(
            f"the job ran {steps} steps but trained on 0 tokens: no block position had a label (are the "
            "assistant turns empty?); it did not train"
        )
    if not any_loss:
        raise JobError(
            f"the job ran {steps} steps on {labels} labelled positions but its loss was exactly 0 at every step: "
            "the loss weights (loss) are too small to give a gradient; it did not train. Use weights near 1"
        )
    if not any_grad:
        raise JobError(
            f"the job ran {steps} steps on {labels} labelled positions but the gradient was exactly 0 at every "
            "step: the loss weights (loss) are too small for the gradient to be represented; it did not train. "
            "Use weights near 1"
        )
    if not weights_changed:
        raise JobError(
            f"the job ran {steps} steps on {labels} labelled positions but the weights did not change at all: "
            "every update was 0 (a learning_rate too small for fp32 weights); it did not train. Raise learning_rate"
        )
