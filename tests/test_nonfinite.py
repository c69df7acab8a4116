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


class Steps(JobCallbacks):
    def __init__(self):
        self.stats = []

    def on_step(self, stats):
        self.stats.append(stats)


@pytest.fixture(scope="module")
def teacher_engine(default_assets):
    """An engine whose step reads the job's loss mix (the teacher's terms need one)."""
    from dflash_core.engine import Engine
    from tests.test_engine import engine_config

    e = Engine(engine_config(["cpu"], teacher=True), default_assets.root.parent.parent).build()
    yield e
    e.close()


@pytest.mark.parametrize(
    "settings, why",
    [
        ({"loss": {"ce": 1e-30}}, "gradient was exactly 0"),
        ({"loss": {"ce": 1e-300}}, "loss was exactly 0"),
        ({"learning_rate": 1e-300}, "weights did not change"),
    ],
    ids=["ce-1e-30", "ce-1e-300", "lr-1e-300"],
)
def test_a_job_whose_update_underflows_fails(teacher_engine, default_assets, tmp_path, settings, why):
    """The data has labels, yet the loss weights or the learning rate are so small that no update
    changes a single bit of the weights: the job fails saying why, and writes no checkpoint."""
    watch = Steps()
    with pytest.raises(JobError) as e:
        teacher_engine.run_job(
            job(default_assets, tmp_path / "out", steps=3, checkpoint_interval=1000, **settings), watch
        )
    assert "did not train" in str(e.value) and why in str(e.value), e.value
    assert len(watch.stats) == 3 and all(s.labels > 0 for s in watch.stats)
    assert not any((tmp_path / "out" / "checkpoints").glob("step-*"))


def test_grad_clip_zero_reports_the_measured_gradient_norm(engine, default_assets, tmp_path):
    """With clipping off the gradient norm is still measured: the non-finite guard and the metrics
    read it, so it must never be a constant."""
    clipped, unclipped = Steps(), Steps()
    engine.run_job(job(default_assets, tmp_path / "a", steps=2, grad_clip=1e6), clipped)
    engine.run_job(job(default_assets, tmp_path / "b", steps=2, grad_clip=0.0), unclipped)
    norms = [s.grad_norm for s in unclipped.stats]
    assert all(n > 0 for n in norms), norms
    assert norms == pytest.approx([s.grad_norm for s in clipped.stats], rel=1e-5)
