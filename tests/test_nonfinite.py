"""A job only succeeds if it trained: non-finite weights from the start (init_from) or late in a
run stop the job FAILED naming the step, before a checkpoint of that step is written, and the
last finite checkpoint stays. Real engine on CPU, real checkpoint files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core.checkpoint import load_weights
from dflash_core.engine import JobCallbacks, JobError
from dflash_core.engine.guards import non_finite_weights
from tests.test_engine import job, make_engine


class Watch(JobCallbacks):
    def __init__(self, replica=None, poison_at=None):
        self.steps, self.checkpoints, self.replica, self.poison_at = [], [], replica, poison_at

    def on_step(self, stats):
        self.steps.append(stats.step)
        if stats.step == self.poison_at:  # a divergence late in the run, as a blown-up update leaves it
            with torch.no_grad():
                next(m for _, m in self.replica.named_masters()).fill_(float("nan"))

    def on_checkpoint(self, path, step, pause_seconds=0.0):
        self.checkpoints.append(step)


@pytest.fixture(scope="module")
def engine(default_assets):
    e = make_engine(default_assets.root.parent.parent, ["cpu"])
    yield e
    e.close()


def test_late_divergence_fails_and_keeps_the_last_finite_checkpoint(engine, default_assets, tmp_path):
    watch = Watch(engine.replicas[0], poison_at=3)
    with pytest.raises(JobError) as e:
        engine.run_job(job(default_assets, tmp_path, steps=8, checkpoint_interval=1, keep_checkpoints=1), watch)
    assert "diverged at step 3" in str(e.value) or "diverged at step 4" in str(e.value), e.value
    assert watch.steps[-1] <= 4 and watch.checkpoints == [1, 2]
    on_disk = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert on_disk == ["step-00000002"], on_disk  # rotation never removed it for a bad one
    assert (
        non_finite_weights(
            load_weights(tmp_path / "checkpoints" / on_disk[0], engine.drafter_config.num_hidden_layers, masters=True)
        )
        == []
    )


def test_nan_init_from_fails_at_step_1_without_a_checkpoint(engine, default_assets, tmp_path):
    engine.run_job(job(default_assets, tmp_path / "good", steps=1, checkpoint_interval=1), Watch())
    source = tmp_path / "good" / "checkpoints" / "step-00000001"
    for path in source.rglob("*.safetensors"):
        tensors = load_file(str(path))
        for t in tensors.values():
            t.fill_(float("nan"))
        save_file(tensors, str(path))
    watch = Watch()
    with pytest.raises(JobError) as e:
        engine.run_job(
            job(default_assets, tmp_path / "bad", steps=4, checkpoint_interval=1, init_from=str(source)), watch
        )
    assert "diverged at step 1" in str(e.value) and "not finite" in str(e.value), e.value
    assert watch.steps == [] and watch.checkpoints == []
    assert not any(Path(tmp_path / "bad" / "checkpoints").glob("step-*"))


def test_a_job_that_trained_on_nothing_fails(engine, default_assets, tmp_path):
    """Empty assistant turns: every document is packed, yet no block position has a label, so the
    loss is 0 by construction. The job fails saying so instead of succeeding."""
    import json

    empty = tmp_path / "empty-answers.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    empty.write_text("".join(json.dumps(record) + "\n" for _ in range(50)))
    watch = Watch()
    with pytest.raises(JobError) as e:
        engine.run_job(job(default_assets, tmp_path / "out", steps=3, datasets=[str(empty)]), watch)
    assert "trained on 0 tokens" in str(e.value), e.value
    assert watch.steps == [1, 2, 3] and watch.checkpoints == []  # not even the last step's
