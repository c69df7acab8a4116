"""A job's objective as plain values (no torch: the service validates jobs with it): the loss
mix and the position weights. step.objectives says what each term computes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# l1: sum |p_d - p_t| = 2 tv, DeepSpec's name and scale for the distribution term (its
# l1_loss_alpha reads as this weight); conf: DSpark's confidence-head BCE (a dspark engine only)
TERMS = ("ce", "kl", "tv", "l1", "conf")
DRAFT_TERMS = ("ce", "kl", "tv", "l1")
POSITION_WEIGHTS = ("decay", "dpace")
DEFAULT_DPACE_ALPHA = 0.5


@dataclass(frozen=True)
class Objective:
    """A job's loss: mix weights of the terms and its position weights."""

    ce: float = 1.0
    kl: float = 0.0
    tv: float = 0.0
    conf: float = 0.0
    position_weights: str = "decay"
    dpace_alpha: float = DEFAULT_DPACE_ALPHA

    @property
    def needs_teacher(self) -> bool:
        return self.kl > 0 or self.tv > 0 or self.conf > 0

    @property
    def is_plain_ce(self) -> bool:
        """The DFlash recipe's loss: CE with decayed position weights."""
        return not self.needs_teacher and self.position_weights == "decay"

    @property
    def mix(self) -> tuple[float, float, float]:
        return (self.ce, self.kl, self.tv)


# weights this large already make a bf16 loss overflow; a mix is about the ratios of its weights
MAX_WEIGHT = 1e4


def parse_loss(value: Any) -> dict[str, float]:
    """A job's `loss` field as {term: weight}: "ce" | "kl" | "tv", or a mix {"ce": w, ...} with
    weights >= 0, not all 0. Raises ValueError saying what is wrong."""
    if isinstance(value, str):
        if value not in TERMS:
            raise ValueError(
                f"unknown loss {value!r}; use one of {', '.join(TERMS)} or a mix such as {{'ce': 0.1, 'tv': 0.9}}"
            )
        return {value: 1.0}
    if not isinstance(value, Mapping) or not value:
        raise ValueError("must be a loss name or a non-empty mix of them, e.g. {'ce': 0.1, 'tv': 0.9}")
    out: dict[str, float] = {}
    for name, weight in value.items():
        if name not in TERMS:
            raise ValueError(f"unknown loss {name!r} in the mix; terms are {', '.join(TERMS)}")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"the weight of {name!r} must be a number")
        try:
            weight = float(weight)  # an integer too large for a float overflows here
        except OverflowError:
            weight = math.inf
        if not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"the weight of {name!r} must lie in [0, {MAX_WEIGHT:g}], got {weight:g}")
        out[name] = weight
    if not any(out.get(t, 0.0) for t in DRAFT_TERMS):
        raise ValueError("the mix must give ce, kl, tv or l1 a weight above 0 (they train the drafter's logits)")
    return out


def objective_of(loss: Mapping[str, float] | None, position_weights: str, dpace_alpha: float) -> Objective:
    mix = dict(loss) if loss is not None else {"ce": 1.0}
    if position_weights not in POSITION_WEIGHTS:
        raise ValueError(f"unknown position weights {position_weights!r}; use one of {', '.join(POSITION_WEIGHTS)}")
    if not 0.0 <= dpace_alpha <= 1.0:
        raise ValueError(f"dpace_alpha must lie in [0, 1], got {dpace_alpha}")
    return Objective(
        ce=mix.get("ce", 0.0),
        kl=mix.get("kl", 0.0),
        tv=mix.get("tv", 0.0) + 2.0 * mix.get("l1", 0.0),
        conf=mix.get("conf", 0.0),
        position_weights=position_weights,
        dpace_alpha=float(dpace_alpha),
    )
