"""GET /jobs from the job list cache is byte for byte what rendering every job afresh gives,
whatever happened to the jobs in between (ended, resumed, ended again, progress moving), and
an ended job's entry is not read again while it stays as it ended. Real SQLite store."""

from __future__ import annotations

import json

from service.job_list import JobListCache, encode
from service.jobs.store import FAILED, STOPPED, SUCCEEDED, JobStore
from service.views import job_json


def _fresh(store: JobStore, state=None, limit=1000) -> bytes:
    return encode({"jobs": [job_json(j) for j in store.list_jobs(state=state, limit=limit)]})


def _create(store: JobStore, job_id: str) -> None:
    spec = {"datasets": ["builtin://train"], "steps": 3, "name": f"caf\u00e9 {job_id}"}
    store.create_job(
        job_id=job_id, name=spec["name"], submission_id=None, spec=spec, fingerprint=job_id,
        train_job_json="{}", output_dir=f"/out/{job_id}",
    )  # fmt: skip


def _step(step: int) -> dict:
    return {"step": step, "total_steps": 3, "loss": 1.0 / step, "tokens_per_second": 10.0 * step,
            "expected_acceptance_length": 1.5, "learning_rate": 1e-3, "epoch": 0.1 * step}  # fmt: skip


def test_the_cached_list_equals_a_fresh_one_through_every_change(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    cache = JobListCache(store)

    def check():
        for state, limit in ((None, 1000), (None, 2), (SUCCEEDED, 1000), ("PENDING", 5)):
            assert cache.render(state, limit) == _fresh(store, state, limit), (state, limit)

    for i in range(6):
        _create(store, f"job-{i}")
    check()
    store.mark_running("job-0")
    store.update_progress("job-0", _step(1))
    check()
    store.update_progress("job-0", _step(2))
    check()
    store.finish("job-0", SUCCEEDED, payload={"steps_done": 2})
    store.stop_if_pending("job-1")
    store.mark_running("job-2")
    store.finish("job-2", FAILED, error="it broke")
    check()
    assert json.loads(cache.render(None, 1000))["jobs"][0]["state"] == SUCCEEDED
    store.requeue("job-2", FAILED, None, 0)  # resumed: no longer as it ended
    check()
    store.mark_running("job-2")
    store.update_progress("job-2", _step(3))
    store.finish("job-2", STOPPED, payload={"reason": "cancelled"})
    check()
    store.close()


def test_an_ended_job_is_not_read_again(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    for i in range(50):
        _create(store, f"job-{i}")
        store.stop_if_pending(f"job-{i}")
    _create(store, "job-pending")
    cache = JobListCache(store)
    read: list[int] = []  # job rows read whole, per statement (SQLite's own trace of what ran)

    def trace(sql: str) -> None:
        if "WHERE id IN (" in sql:
            read.append(sql.count("'job-"))

    store._db.set_trace_callback(trace)
    first = cache.render(None, 1000)
    second = cache.render(None, 1000)
    assert first == second == _fresh(store)
    assert read == [51, 1]  # the second render reads the pending job only
    store.close()
