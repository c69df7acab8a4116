"""The rank protocol's one-process twin answers every call the job loop makes of a group, with
the same signature, and the control vector carries a step's statistics exactly."""

from __future__ import annotations

import concurrent.futures as cf
import inspect

import pytest
import torch

from dflash_core.engine.ranks import Control, GroupRanks, SoloRanks
from dflash_core.engine.replica import StepAccumulator


def _calls(cls: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}


def test_solo_and_group_ranks_answer_the_same_calls():
    solo, group = _calls(SoloRanks), _calls(GroupRanks)
    assert set(solo) <= set(group), sorted(set(solo) - set(group))
    for name, signature in solo.items():
        assert list(signature.parameters) == list(group[name].parameters), name


def _done(value: object = None, error: BaseException | None = None) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_exception(error) if error is not None else f.set_result(value)
    return f


def test_one_process_raises_the_first_failure_of_a_step_and_stops_on_a_cancel():
    solo = SoloRanks()
    first, second = RuntimeError("replica 0"), RuntimeError("replica 1")
    with pytest.raises(RuntimeError, match="replica 0"):
        solo.exchange_step([_done(error=first), _done(error=second)], None, False)
    with pytest.raises(ValueError, match="host sum"):
        solo.exchange_step([_done(1)], ValueError("host sum"), False)
    assert solo.exchange_step([_done(1)], None, True) == (None, None)
    assert solo.stops_before_step(True) and not solo.stops_before_step(False)


def test_the_control_vector_carries_a_step_exactly():
    accs = [
        StepAccumulator(torch.tensor(1.25), torch.tensor([3.0, 2.0, 1.0]), torch.tensor([4.0, 4.0, 2.0]), 100, 2),
        StepAccumulator(torch.tensor(0.5), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([4.0, 3.0, 1.0]), 60, 2),
    ]
    totals = StepAccumulator.merged(accs)
    control = Control(block_size=3, world=2)
    vector = control.new()
    control.pack(vector, totals)
    back = control.unpack(vector + vector)  # two ranks with the same step
    assert float(back.loss_sum) == 2 * 1.75 and back.micro_batches == 8 and back.context_tokens == 320
    assert torch.equal(back.correct, torch.tensor([8.0, 4.0, 4.0]))
    assert torch.equal(back.counted, torch.tensor([16.0, 14.0, 6.0]))
    assert not vector[Control.FAILED] and control.new(failed=True)[Control.FAILED] == 1
