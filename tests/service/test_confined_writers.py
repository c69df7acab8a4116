"""Every writer of a job stays under the output roots: the TensorBoard writer is refused a
`tensorboard` symlink planted in the output directory and an output directory swapped for a
symlink while the job waits in the queue, as the checkpoint writer is. Real daemon, real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.tracking import Tracker


def _files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def test_tracker_refuses_a_planted_tensorboard_symlink(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "job").mkdir(parents=True)
    outside.mkdir()
    (root / "job" / "tensorboard").symlink_to(outside)
    tracker = Tracker(["tensorboard"], job_id="job-1", name=None, output_dir=str(root / "job"), spec={}, roots=[root])
    tracker.close()
    assert _files_under(outside) == []
    assert tracker.errors and tracker.errors[0]["backend"] == "tensorboard"
    assert "not a plain directory" in tracker.errors[0]["error"]


def test_tracker_writes_through_the_directory_it_opened(tmp_path):
    """The event file lands in the directory opened at the start, even when the output directory
    is replaced by a symlink afterwards: writes go through the held descriptor."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    tracker = Tracker(["tensorboard"], job_id="job-1", name=None, output_dir=str(root / "job"), spec={}, roots=[root])
    (root / "job").rename(root / "moved")
    (root / "job").symlink_to(outside)
    tracker._log({"train/loss": 1.0}, 1)
    tracker.close()
    assert _files_under(outside) == []
    assert list((root / "moved" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow  # a daemon and a job writing TensorBoard events
def test_daemon_tensorboard_never_escapes(daemon, tmp_path):
    d = daemon
    outside = tmp_path / "outside"
    outside.mkdir()
    # 1. a tensorboard symlink inside the output directory
    planted = d.data_dir / "planted"
    planted.mkdir()
    (planted / "tensorboard").symlink_to(outside)
    job = d.submit({"datasets": ["builtin://train"], "steps": 2, "output_dir": str(planted)})
    assert d.wait_terminal(job["id"])["state"] == "SUCCEEDED"
    events = [e for e in d.events(job["id"]) if e["kind"] == "tracking"]
    assert events and events[0]["backend"] == "tensorboard", events
    assert str(outside) not in events[0]["error"]
    # 2. an output directory swapped for a symlink while its job waits behind another
    first = d.submit({"datasets": ["builtin://train"], "steps": 400, "checkpoint_interval": 1000})
    swapped = d.data_dir / "swapped"
    second = d.submit({"datasets": ["builtin://train"], "steps": 2, "output_dir": str(swapped)})
    assert d.job(second["id"])["state"] == "PENDING"
    if swapped.exists():
        swapped.rmdir()
    swapped.symlink_to(outside)
    d.http.post(f"/jobs/{first['id']}/cancel")
    ended = d.wait_terminal(second["id"])
    assert ended["state"] == "FAILED" and "not a plain directory" in ended["error"], ended
    assert _files_under(outside) == []
