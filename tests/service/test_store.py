"""The job store's checkpoint records follow what the engine reports (a real SQLite file)."""

from service.jobs.store import JobStore


def test_rotated_checkpoints_are_forgotten_and_the_newest_stays(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(
        job_id="job-1",
        name=None,
        submission_id=None,
        spec={},
        fingerprint="f",
        train_job_json="{}",
        output_dir=str(tmp_path / "out"),
    )
    for step in (10, 20, 30):
        store.add_checkpoint("job-1", step, str(tmp_path / "out" / "checkpoints" / f"step-{step:08d}"))
    store.forget_checkpoints("job-1", [str(tmp_path / "out" / "checkpoints" / "step-00000010")])
    assert [c["step"] for c in store.checkpoints("job-1")] == [20, 30]
    job = store.get_job("job-1")
    assert job.last_checkpoint.endswith("step-00000030") and [c["step"] for c in job.checkpoints] == [20, 30]
