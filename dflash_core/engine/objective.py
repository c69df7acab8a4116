"""A job's objective checked against what the engine warmed, and turned into step.objectives'
Objective. The objective step (mix weights, D-PACE) runs only on an engine warmed with the
teacher (`[engine] teacher = true`, implied by `recipe = "dspark"`): its target runs to the final
norm and its recorded step reads the objective's tensors; an engine without it runs the DFlash
block CE step, unchanged."""

from __future__ import annotations

from ..recipes import recipe_named
from ..step.objective_spec import POSITION_WEIGHTS, Objective, objective_of, parse_loss
from .api import JobError
from .config import TrainJob


def job_objective(job: TrainJob, recipe: str = "dflash") -> Objective:
    """The job's Objective (its loss, else the recipe's default); raises JobError naming the
    field that is wrong."""
    try:
        mix = parse_loss(job.loss) if job.loss is not None else None
    except ValueError as e:
        raise JobError(str(e), "loss") from None
    default = recipe_named(recipe).loss
    if mix is None and default is not None:
        mix = dict(default)
    if job.position_weights not in POSITION_WEIGHTS:
        raise JobError(
            f"unknown position weights {job.position_weights!r}; use one of {', '.join(POSITION_WEIGHTS)}",
            "position_weights",
        )
    try:
        return objective_of(mix, job.position_weights, job.dpace_alpha)
    except ValueError as e:
        raise JobError(str(e), "dpace_alpha") from None


def check_objective(job: TrainJob, teacher: bool, recipe: str = "dflash") -> Objective:
    """The job's Objective if this engine can train it as warmed."""
    if job.recipe is not None and job.recipe != recipe:
        raise JobError(
            f"{job.recipe!r} differs from the warmed engine's recipe {recipe!r}; the engine warms one recipe "
            "(its shapes and heads) and does not rebuild at runtime: start a daemon with "
            f'[engine] recipe = "{job.recipe}"',
            "recipe",
        )
    objective = job_objective(job, recipe)
    heads = recipe_named(recipe).heads
    if objective.conf > 0 and not heads:
        raise JobError('conf trains DSpark\'s confidence head: the daemon must warm recipe = "dspark"', "loss")
    if heads and objective.position_weights != "decay":
        raise JobError(
            "the dspark recipe weights positions by decay (its Markov head's gradient is summed as the logits "
            "pass, before D-PACE could read the block's probabilities)",
            "position_weights",
        )
    if teacher:
        return objective
    if objective.needs_teacher:
        raise JobError(
            "kl and tv distil the target's next-token distribution: the daemon must be started with "
            "[engine] teacher = true (the target then runs to its final norm); this one trains the block CE only",
            "loss",
        )
    if objective.position_weights != "decay":
        raise JobError(
            "D-PACE weights run in the objective step, which the daemon warms with [engine] teacher = true; "
            "this one runs the DFlash block CE step with decayed weights only",
            "position_weights",
        )
    return objective
