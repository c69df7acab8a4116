"""Experiment tracking: TensorBoard event files a job writes under its output directory hold its
per-step scalars, read back from the files as TensorBoard reads them."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.tracking import Tracker


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TFRecord event files under `directory` (length, crc, data, crc frames)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@dataclass
class Stats:
    step: int
    loss: float
    expected_acceptance_length: float = 2.0
    learning_rate: float = 1e-3
    grad_norm: float = 0.5
    tokens_per_second: float = 1000.0
    step_seconds: float = 0.1
    epoch: float = 0.1
    position_accuracy: list[float] = field(default_factory=lambda: [0.9, 0.5])


def test_tensorboard_events_hold_every_step(tmp_path):
    tracker = Tracker(["tensorboard"], job_id="job-1", name="t", output_dir=str(tmp_path), spec={"steps": 3})
    for step, loss in ((1, 3.0), (2, 2.5), (3, 2.0)):
        tracker.step(Stats(step, loss))
    tracker.eval(3, {"acceptance_length": 3.25})
    tracker.checkpoint(3, 0.012)
    tracker.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert scalars["train/accuracy/position_02"] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert scalars["eval/acceptance_length"] == [(3, 3.25)] and len(scalars["checkpoint/pause_seconds"]) == 1


@pytest.mark.slow  # jobs with TensorBoard event files
def test_a_jobs_tensorboard_events_and_unknown_trackers(daemon):
    """By default (the daemon's report_to) a job writes TensorBoard events under its output
    directory with one loss per step; a tracker whose package is missing is a 422 naming report_to."""
    import importlib.util

    d = daemon
    job = d.submit({"datasets": ["builtin://train"], "steps": 4, "checkpoint_interval": 2})
    assert d.wait_terminal(job["id"])["state"] == "SUCCEEDED"
    scalars = read_scalars(Path(job["output_dir"]) / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert len(scalars["checkpoint/pause_seconds"]) == 2
    for backend in ("wandb", "mlflow"):
        if importlib.util.find_spec(backend) is None:
            r = d.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, "report_to": [backend]})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "report_to", r.text
