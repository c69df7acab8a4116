"""A job's objective checked against what the engine warmed, and turned into step.objectives'
Objective. The objective step (mix weights, D-PACE) runs only on an engine warmed with the
teacher (`[engine] teacher = true`): its target runs to the final norm and its recorded step
reads the objective's tensors; an engine without it runs the DFlash block CE step, unchanged."""

from __future__ import annotations

from ..step.objectives import POSITION_WEIGHTS, Objective, objective_of, parse_loss
from .api import JobError
from .config import TrainJob


def job_objective(job: TrainJob) -> Objective:
    """The job's Objective; raises JobError naming the field that is wrong."""
    try:
        mix = parse_loss(job.loss) if job.loss is not None else None
    except ValueError as e:
        raise JobError(str(e), "loss") from None
    if job.position_weights not in POSITION_WEIGHTS:
        raise JobError(
            f"unknown position weights {job.position_weights!r}; use one of {', '.join(POSITION_WEIGHTS)}",
            "position_weights",
        )
    try:
        return objective_of(mix, job.position_weights, job.dpace_alpha)
    except ValueError as e:
        raise JobError(str(e), "dpace_alpha") from None


def check_objective(job: TrainJob, teacher: bool) -> Objective:
    """The job's Objective if this engine can train it as warmed."""
    objective = job_objective(job)
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
