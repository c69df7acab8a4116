"""An unknown field's hint comes from the spec of the job's own kind, and a field of the other
kind's spec says which kind it belongs to (the same parse POST /jobs runs)."""

from __future__ import annotations

import pytest

from service.jobs.by_kind import parse_spec
from service.jobs.schemas import SpecError

REGEN = {"kind": "regenerate", "datasets": ["builtin://heldout"]}
TRAIN = {"datasets": ["builtin://train"], "steps": 3}


def _message(body: dict, field: str) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(body)
    return {err["field"]: err["message"] for err in e.value.errors}[field]


def test_a_regeneration_is_not_told_of_training_fields():
    assert "did you mean 'max_new_tokens'" in _message({**REGEN, "max_new_token": 8}, "max_new_token")
    assert '"kind": "train"' in _message({**REGEN, "steps": 3}, "steps")
    assert "learning_rate" not in _message({**REGEN, "lr": 3e-4}, "lr")


def test_a_training_job_given_a_regeneration_field_is_pointed_at_its_kind():
    assert '"kind": "regenerate"' in _message({**TRAIN, "max_new_tokens": 8}, "max_new_tokens")
    assert "did you mean 'learning_rate'" in _message({**TRAIN, "lr": 3e-4}, "lr")


def test_loss_is_parsed_once_and_kept_as_given():
    """The spec keeps `loss` as the user wrote it (what GET /jobs shows); the mix the engine
    gets is the one parsed when the spec was validated, copies included."""
    spec = parse_spec({"datasets": ["builtin://train"], "steps": 2, "loss": "kl"})
    assert spec.loss == "kl" and spec.loss_mix == {"kl": 1.0}
    assert spec.model_copy(update={"steps": 3}).loss_mix == {"kl": 1.0}
    mixed = parse_spec({"datasets": ["builtin://train"], "steps": 2, "loss": {"ce": 1, "tv": 0.5}})
    assert mixed.loss_mix == {"ce": 1.0, "tv": 0.5}
    assert parse_spec({"datasets": ["builtin://train"], "steps": 2}).loss_mix is None
