"""A job runs, and resumes, under the roots the daemon is configured with when it runs: an
output root removed from the configuration (and the daemon restarted) is not written by a job
queued or running before; a default output_dir outside the output roots is refused at once.
Real daemon, restarted with its configuration rewritten."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _set_output_roots(d, roots) -> None:
    text = d.config_path.read_text().splitlines()
    kept = [line for line in text if not line.startswith("output_roots")]
    kept.insert(1, "output_roots = [" + ", ".join(f'"{r}"' for r in roots) + "]")
    d.config_path.write_text("\n".join(kept) + "\n")


def _files_under(directory):
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


@pytest.fixture(scope="module")
def extra_root(tmp_path_factory):
    return tmp_path_factory.mktemp("extra-root")


@pytest.fixture(scope="module")
def daemon(make_daemon, extra_root):
    """The module's daemon, with output_roots = [its data dir, extra_root]: the overlap test runs
    its checks on it, then the roots test rewrites its roots and restarts it (in this order)."""
    d = make_daemon(start=False)
    _set_output_roots(d, [d.data_dir, extra_root])
    d.start()
    d.wait_ready()
    return d


def test_an_output_dir_overlapping_the_data_dir_or_another_jobs_is_refused(daemon):
    d = daemon
    for raw in (str(d.data_dir), str(d.data_dir.parent)):
        r = d.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, "output_dir": raw})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "output_dir", r.text
    first = d.submit({"datasets": ["builtin://train"], "steps": 2, "output_dir": str(d.data_dir / "runs" / "a")})
    assert d.wait_terminal(first["id"])["state"] == "SUCCEEDED"
    for nested in (d.data_dir / "runs" / "a" / "checkpoints" / "b", d.data_dir / "runs"):
        r = d.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 1, "output_dir": str(nested)})
        assert r.status_code == 409 and first["id"] in r.text, r.text


def test_roots_are_those_in_force_when_the_job_runs(daemon, extra_root):
    d, extra = daemon, extra_root
    long = d.submit({"datasets": ["builtin://train"], "steps": 100000, "checkpoint_interval": 1})
    queued = d.submit({"datasets": ["builtin://train"], "steps": 2, "output_dir": str(extra / "queued")})
    d.wait_job(long["id"], lambda j: (j["progress"]["last_checkpoint_step"] or 0) >= 1)
    assert d.job(queued["id"])["state"] == "PENDING"
    d.stop()

    # the extra root is gone from the configuration: the queued job may not write there
    _set_output_roots(d, [d.data_dir])
    d.start()
    d.wait_ready()
    d.wait_job(long["id"], lambda j: j["resumes"] >= 1 and j["state"] == "RUNNING")
    d.http.post(f"/jobs/{long['id']}/cancel")
    ended = d.wait_terminal(queued["id"])
    assert ended["state"] == "FAILED", ended
    assert "output_dir" in ended["error"] and "output_roots now" in ended["error"], ended["error"]
    assert _files_under(extra) == []

    # a job that was running resumes only under the roots in force: its output root is gone now
    again = d.submit({"datasets": ["builtin://train"], "steps": 100000, "checkpoint_interval": 1})
    d.wait_job(again["id"], lambda j: (j["progress"]["last_checkpoint_step"] or 0) >= 1)
    d.stop()
    before = sorted(p.name for p in (d.data_dir / "jobs" / again["id"] / "checkpoints").iterdir())
    _set_output_roots(d, [extra])
    d.start()
    d.wait_ready()
    resumed = d.wait_terminal(again["id"])
    assert resumed["state"] == "FAILED" and "output_roots now" in resumed["error"], resumed
    assert sorted(p.name for p in (d.data_dir / "jobs" / again["id"] / "checkpoints").iterdir()) == before

    # with the data directory outside the output roots, the default output_dir is refused at once
    r = d.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 2})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "output_dir", r.text
