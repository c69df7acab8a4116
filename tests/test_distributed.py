"""Training across processes on torch.distributed (gloo, CPU): real processes started by torchrun.

Engine level: a 2-rank job equals a 1-process job with the same global batch, and the ranks end
bit-identical. Service level (tests/service/test_distributed_service.py): health, loss of a rank,
restart and resume through the real daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.engine import JobCallbacks, TrainJob
from service.demo import free_port
from tests.helpers import train_spec
from tests.test_engine import make_engine

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun_engine(out: Path, specs: list[dict], nproc: int = 2, timeout: float = 300) -> list[dict]:
    """Run tests/distributed/engine_rank.py on `nproc` ranks, the jobs `specs` one after the other
    in one group; each rank's result."""
    cmd = [
        *TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
        "tests.distributed.engine_rank",
        str(out),
        json.dumps(specs),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


class Losses(JobCallbacks):
    def __init__(self):
        self.losses = []

    def on_step(self, stats):
        self.losses.append(stats.loss)


def six_steps(assets, output_dir, **extra) -> dict:
    """A 6-step job checkpointing at steps 3 and 6."""
    return train_spec(assets, output_dir, 6, checkpoint_interval=3, **extra)


@pytest.fixture(scope="module")
def group(default_assets, tmp_path_factory):
    """One 2-rank group (starting one takes most of a test's time) running the tests' jobs in this
    order: a job that fails on rank 0 before its first step, a job whose rank 1 weights diverge,
    and a plain job, which leaves the ranks' weights. The later jobs run in a group the earlier
    ones used. The output dir, each job's spec and rank 0's result, and rank 1's result."""
    out = tmp_path_factory.mktemp("group")
    (out / "unwritable").mkdir()
    (out / "unwritable" / "checkpoints").write_text("not a directory")  # rank 0 cannot open it
    specs = {
        "fails_on_rank_0": dict(
            datasets=[str(default_assets.train)], output_dir=str(out / "unwritable"), steps=4, seed=1
        ),
        "diverges": six_steps(default_assets, out / "diverges", diverge_rank_1_at_step=4),
        "plain": six_steps(default_assets, out / "plain"),
    }
    lead, other = torchrun_engine(out, list(specs.values()))
    return {"out": out, "specs": specs, "jobs": dict(zip(specs, lead["jobs"], strict=True)), "other": other}


def test_two_ranks_equal_one_process_with_the_same_global_batch(group, default_assets, tmp_path):
    spec, ran = group["specs"]["plain"], group["jobs"]["plain"]
    assert ran["status"] == "SUCCEEDED", ran
    assert group["other"]["ended"] == "rank 0 shut the group down"

    # one process, one replica, two micro-batches per step: the same 2 micro-batches per step
    single = make_engine(default_assets.root.parent.parent, ["cpu"])
    rec = Losses()
    single.run_job(TrainJob(**{**spec, "output_dir": str(tmp_path / "single-job"), "grad_accum": 2}), rec)
    assert len(rec.losses) == len(ran["losses"]) == 6
    for a, b in zip(ran["losses"], rec.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)

    out = group["out"]
    w0, w1 = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "the ranks' weights differ"
    ws = single.replicas[0].weights_state()
    for k, v in w0.items():
        torch.testing.assert_close(v, ws[k], rtol=1e-4, atol=1e-6)
    # rank 0 alone wrote the checkpoints, with the group's replica count in their training state
    steps = sorted(p.name for p in (out / "plain" / "checkpoints").iterdir())
    assert steps == ["step-00000003", "step-00000006"], steps


def test_ranks_whose_weights_diverge_fail_the_job_before_a_checkpoint(group):
    lead = group["jobs"]["diverges"]
    assert lead["status"] == "FAILED", lead
    assert "step 6: the weights of rank(s) 1 differ from rank 0's" in lead["error"], lead["error"]
    steps = sorted(p.name for p in (group["out"] / "diverges" / "checkpoints").iterdir())
    assert steps == ["step-00000003"], steps  # the diverged step-6 state was not written


def test_a_failure_on_rank_0_before_the_first_step_reaches_the_other_ranks_at_once(group):
    """Rank 0 cannot open the job's checkpoint directory (a file is in the way) after the ranks
    agreed to start: it reports the failure in the collective the others wait in, so no rank sits
    out the collective timeout and the group stays usable (the group's next jobs run in it)."""
    lead = group["jobs"]["fails_on_rank_0"]
    assert lead["status"] == "FAILED" and "checkpoints" in lead["error"], lead
    assert not lead["resumable"]
    # the failure did not break the group: the next jobs ran in it, and rank 1 followed to the end
    assert group["jobs"]["plain"]["status"] == "SUCCEEDED"
    assert group["other"]["ended"] == "rank 0 shut the group down"
    # a rank sitting out the collective timeout (60 s) would hold up the start of the next job
    assert lead["seconds"] + group["jobs"]["diverges"]["seconds"] < 60
