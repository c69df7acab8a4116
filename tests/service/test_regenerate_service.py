"""Regeneration jobs through a real daemon: bad specs are 422s naming the field; a regeneration
killed with SIGKILL resumes at the next start with no row lost and none written twice (compared
with an uninterrupted run under greedy decoding); its output is a dataset for a training job,
named by its directory or as job://<id>; progress, events and metrics show it."""

from __future__ import annotations

import json
import subprocess

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

SHARD_ROWS = 4


@pytest.fixture(scope="module")
def daemon(make_daemon):
    # two slots: slow enough on the CPU for a kill to land between two shards
    d = make_daemon(engine={"generate_slots": 2})
    d.wait_ready()
    return d


def _spec(**kw):
    spec = {
        "kind": "regenerate",
        "datasets": ["builtin://heldout"],
        "max_new_tokens": 48,
        "shard_rows": SHARD_ROWS,
    }
    spec.update(kw)
    return spec


def _errors(r):
    assert r.status_code == 422, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


def test_bad_specs_name_the_field(daemon, tmp_path):
    http = daemon.http
    assert "top_q" in _errors(http.post("/jobs", json=_spec(top_q=0.9)))
    assert "kind" in _errors(http.post("/jobs", json=_spec(kind="distill")))
    assert "max_new_tokens" in _errors(http.post("/jobs", json=_spec(max_new_tokens=10**5)))
    assert "temperature" in _errors(http.post("/jobs", json=_spec(temperature=-1)))
    empty = daemon.data_dir / "empty.jsonl"
    empty.write_text("")
    assert "datasets[0]" in _errors(http.post("/jobs", json=_spec(datasets=[str(empty)])))
    no_user = daemon.data_dir / "no_user.jsonl"
    no_user.write_text(json.dumps({"messages": [{"role": "system", "content": "hi"}]}) + "\n")
    message = _errors(http.post("/jobs", json=_spec(datasets=[str(no_user)])))["datasets[0]"]
    assert "no_user.jsonl:1" in message and "no user turn" in message
    too_long = daemon.data_dir / "too_long.jsonl"
    too_long.write_text(json.dumps({"prompt": " ".join(["apple"] * 600)}) + "\n")
    assert "generation length" in _errors(http.post("/jobs", json=_spec(datasets=[str(too_long)])))["datasets[0]"]
    unknown = _errors(http.post("/jobs", json={"datasets": ["job://job-nope"], "steps": 2}))
    assert "no job" in unknown["datasets[0]"]


def test_a_regeneration_starts_in_a_new_or_empty_output_dir(daemon):
    """It continues from what its output directory holds and sweeps its own leftovers there, so a
    directory holding anything else is refused: nothing of the user's is overwritten or deleted."""
    held = daemon.data_dir / "holds-files"
    (held / ".tmp-mine").mkdir(parents=True)
    (held / "shard-00000.parquet").write_bytes(b"precious")
    prompts = daemon.data_dir / "prompt-dir"
    prompts.mkdir()
    (prompts / "p.jsonl").write_text(json.dumps({"prompt": "apple pear"}) + "\n")
    for output_dir in (held, prompts):  # the second: its own dataset's directory
        r = daemon.http.post("/jobs", json=_spec(datasets=[str(prompts)], output_dir=str(output_dir)))
        assert r.status_code == 409 and "already holds files" in r.json()["detail"], r.text
    assert (held / "shard-00000.parquet").read_bytes() == b"precious" and (held / ".tmp-mine").is_dir()
    # nor into what the daemon keeps for itself: its embedded assets (a dataset root), its caches
    for own in ("defaults/v2", "inductor-cache/x", "cache"):
        r = daemon.http.post("/jobs", json=_spec(datasets=[str(prompts)], output_dir=own))
        assert r.status_code == 422 and "keeps for itself" in r.json()["errors"][0]["message"], r.text
        r = daemon.http.post("/jobs", json={"datasets": ["builtin://train"], "steps": 2, "output_dir": own})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "output_dir", r.text
    empty = daemon.data_dir / "empty-out"
    empty.mkdir()
    job = daemon.submit(_spec(datasets=[str(prompts)], output_dir=str(empty), max_new_tokens=4))
    assert daemon.wait_terminal(job["id"], timeout=120)["state"] == "SUCCEEDED"


def _rows(output_dir):
    manifest = json.loads((output_dir / "regeneration.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += pq.read_table(output_dir / shard["file"]).to_pylist()
    return manifest, rows


def test_killed_regeneration_resumes_without_loss_or_duplicates(daemon):
    d = daemon
    reference = d.submit(_spec(output_dir=str(d.data_dir / "regen-ref")))
    assert reference["kind"] == "regenerate"
    done = d.wait_terminal(reference["id"], timeout=300)
    assert done["state"] == "SUCCEEDED", done
    progress = done["progress"]["data"]
    assert progress["prompts_done"] == progress["prompts_total"] == 64
    assert progress["tokens_generated"] > 0 and progress["tokens_per_second"] > 0
    _, ref_rows = _rows(d.data_dir / "regen-ref")

    job = d.submit(_spec(output_dir=str(d.data_dir / "regen-killed")))
    d.wait_job(job["id"], lambda j: (j["progress"]["last_checkpoint_step"] or 0) >= 2 * SHARD_ROWS, timeout=300)
    d.kill()
    killed_manifest, _ = _rows(d.data_dir / "regen-killed")
    assert 0 < len(killed_manifest["shards"]) < 64 // SHARD_ROWS
    d.start()
    d.wait_ready()
    final = d.wait_terminal(job["id"], timeout=300)
    assert final["state"] == "SUCCEEDED", final
    manifest, rows = _rows(d.data_dir / "regen-killed")
    assert manifest["complete"] and manifest["counts"]["rows"] == len(rows) == len(ref_rows) == 64
    # a regeneration reports no training scalars: no experiment tracking directory of its own
    assert sorted(p.name for p in (d.data_dir / "regen-killed").iterdir() if not p.name.startswith("shard-")) == [
        "regeneration.json"
    ]

    def key(r):
        return (r["source"], r["sample"])

    assert sorted(map(key, rows)) == sorted(map(key, ref_rows))  # none lost, none twice
    assert sorted(rows, key=key) == sorted(ref_rows, key=key)  # greedy: the same answers
    assert [e["kind"] for e in d.events(job["id"])].count("resumed") == 1

    # the output is a dataset: the HF parquet loader reads it, and so do training jobs
    import datasets

    loaded = datasets.load_dataset("parquet", data_files=str(d.data_dir / "regen-killed" / "*.parquet"), split="train")
    assert len(loaded) == 64 and loaded[0]["messages"][-1]["role"] == "assistant"
    metrics = d.http.get("/metrics").text
    assert "dflash_generate_tokens_total{" in metrics and "dflash_generate_tokens_per_second{" in metrics

    by_id = d.submit({"datasets": [f"job://{reference['id']}"], "steps": 3, "checkpoint_interval": 3})
    by_dir = d.submit({"datasets": [str(d.data_dir / "regen-killed")], "steps": 3, "checkpoint_interval": 3})
    for train in (by_id, by_dir):
        assert train["kind"] == "train"
        ended = d.wait_terminal(train["id"], timeout=300)
        assert ended["state"] == "SUCCEEDED", ended
        data = next(e for e in d.events(train["id"]) if e["kind"] == "data")
        assert data["documents"] == 64


def test_cli_regenerates_then_trains_on_the_output(daemon):
    """The README's example: the example job files, submitted and followed with the CLI."""
    from tests.service.test_cli import REPO_ROOT, cli

    examples = REPO_ROOT / "examples"
    done = cli("submit", str(examples / "regenerate-job.json"), "--follow", url=daemon.url, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prompts 64/64" in done.stdout and "SUCCEEDED" in done.stdout
    assert "decoder: 2 slots x 512 positions" in done.stdout and "CUDA graph no" in done.stdout
    assert "prompt tokens riding per step 0" in done.stdout  # the CPU prefills every prompt
    job_id = done.stdout.split()[0]
    status = cli("status", job_id, url=daemon.url)
    assert "kind        regenerate" in status.stdout and "prompts 64/64" in status.stdout
    trained = cli("submit", str(examples / "train-on-regenerated.json"), "--follow", url=daemon.url, timeout=600)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "SUCCEEDED at step 40/40" in trained.stdout


def test_a_job_output_replaced_by_a_link_is_not_read(daemon, tmp_path):
    """job://<id> reads the directory the regeneration wrote: replaced by a symlink to a place
    outside the roots it is refused, and what lies there is neither read nor echoed."""
    import shutil

    d = daemon
    prompts = d.data_dir / "two-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("yes", "no")))
    out = d.data_dir / "regen-linked"
    job = d.submit(_spec(datasets=[str(prompts)], max_new_tokens=4, output_dir=str(out)))
    assert d.wait_terminal(job["id"], timeout=300)["state"] == "SUCCEEDED"
    outside = tmp_path / "elsewhere"
    shutil.copytree(out, outside)
    manifest = json.loads((outside / "regeneration.json").read_text())
    manifest["secret_key_outside"] = 1
    (outside / "regeneration.json").write_text(json.dumps(manifest))
    out.rename(d.data_dir / "regen-moved")
    out.symlink_to(outside)
    message = _errors(d.http.post("/jobs", json={"datasets": [f"job://{job['id']}"], "steps": 2}))["datasets[0]"]
    assert "no longer a plain directory" in message and str(outside) not in message

    # a manifest planted as a symlink in a directory a training job names is not followed either
    planted = d.data_dir / "regen-planted"
    planted.mkdir()
    (planted / "regeneration.json").symlink_to(outside / "regeneration.json")
    message = _errors(d.http.post("/jobs", json={"datasets": [str(planted)], "steps": 2}))["datasets[0]"]
    assert "symlink" in message and "secret_key_outside" not in message and str(outside) not in message


def test_a_stopped_regeneration_shows_no_eta(daemon):
    """A time left is estimated only while the job runs: once it is STOPPED neither the API nor the
    CLI's status reports one."""
    from tests.service.test_cli import cli

    d = daemon
    job = d.submit(_spec(output_dir=str(d.data_dir / "regen-stopped")))
    d.wait_job(job["id"], lambda j: (j["progress"]["data"] or {}).get("eta_seconds") is not None, timeout=300)
    d.http.post(f"/jobs/{job['id']}/cancel")
    stopped = d.wait_terminal(job["id"], timeout=300)
    assert stopped["state"] == "STOPPED", stopped
    data = stopped["progress"]["data"]
    assert data["rows_done"] < data["rows_total"] and data["eta_seconds"] is None, data
    status = cli("status", job["id"], url=d.url)
    assert status.returncode == 0 and "prompts " in status.stdout and "ETA" not in status.stdout, status.stdout


def test_a_regeneration_failed_before_its_first_shard_resumes(daemon):
    """A full disk fails a regeneration before it wrote a shard; with space back, resuming it
    continues into the same output_dir (its unit of resume is the manifest, not a checkpoint)."""
    from tests.helpers import mount_tmpfs, unmount

    d = daemon
    prompts = d.data_dir / "three-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("yes", "no", "maybe")))
    small = d.data_dir / "small-disk"
    mount_tmpfs(small, "size=256k")
    try:
        job = d.submit(_spec(datasets=[str(prompts)], max_new_tokens=4, shard_rows=2, output_dir=str(small / "out")))
        failed = d.wait_terminal(job["id"], timeout=300)
        assert failed["state"] == "FAILED" and "ENOSPC" in failed["error"], failed
        assert not list((small / "out").glob("shard-*.parquet"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        r = d.http.post(f"/jobs/{job['id']}/resume")
        assert r.status_code == 202, r.text
        done = d.wait_terminal(job["id"], timeout=300)
        assert done["state"] == "SUCCEEDED", done
        manifest, rows = _rows(small / "out")
        assert manifest["complete"] and len(rows) == 3
    finally:
        unmount(small)


def test_a_regeneration_failed_before_its_first_shard_gives_its_output_dir_up(daemon):
    """Submitted again into the same output_dir, with other settings, once the first one FAILED
    before writing a shard: nothing is there to keep, so the new job takes the directory."""
    from tests.helpers import mount_tmpfs, unmount

    d = daemon
    prompts = d.data_dir / "two-more-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("up", "down")))
    small = d.data_dir / "small-disk-2"
    mount_tmpfs(small, "size=256k")
    try:
        spec = _spec(datasets=[str(prompts)], max_new_tokens=4, shard_rows=2, output_dir=str(small / "out"))
        first = d.submit(spec)
        assert d.wait_terminal(first["id"], timeout=300)["state"] == "FAILED"
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        again = d.submit({**spec, "max_new_tokens": 5})
        done = d.wait_terminal(again["id"], timeout=300)
        assert done["state"] == "SUCCEEDED", done
        manifest, rows = _rows(small / "out")
        assert manifest["complete"] and manifest["plan"]["sampling"]["max_new_tokens"] == 5 and len(rows) == 2
        # a job that wrote something keeps its directory
        r = d.http.post("/jobs", json={**spec, "max_new_tokens": 6})
        assert r.status_code == 409 and again["id"] in r.text, r.text
    finally:
        unmount(small)
