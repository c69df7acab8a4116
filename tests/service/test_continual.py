"""Continual jobs through one real daemon: bad specs are 422s naming the field; the job trains on
what its watched source holds and on records POSTed to it, idles when nothing new arrives, publishes
versions (complete before `latest` moves, versions.json, target identity, the reload hook called on
a real HTTP server), yields to a queued job and resumes after it, and stops when cancelled; records
accepted before a SIGKILL are in the spool and trained after the restart."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.cli_continual import _batch_lines
from service.client import DaemonClient
from service.demo import free_port

pytestmark = pytest.mark.slow

RELOAD_SERVER = """
import http.server, pathlib, sys
out = pathlib.Path(sys.argv[2])
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with out.open("ab") as f:
            f.write(self.path.encode() + b" " + body + b"\\n")
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Hook).serve_forever()
"""


def conversation(i: int) -> dict:
    a, b = i % 17, (3 * i) % 11
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}. Anything else about numbers?"},
        ]
    }


def write_lines(path: Path, records: list[dict], mode: str = "a") -> None:
    with path.open(mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def errors(r: httpx.Response) -> dict[str, str]:
    assert r.status_code == 422, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


@pytest.fixture(scope="module")
def daemon(make_daemon):
    """A daemon of the module's own: a continual job swaps the target it serves in place."""
    d = make_daemon()
    d.wait_ready()
    return d


@pytest.fixture(scope="module")
def reload_hook(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook")
    (root / "hook.py").write_text(RELOAD_SERVER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(root / "hook.py"), str(port), str(root / "received")])
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.post(f"http://127.0.0.1:{port}/probe", content=b"{}")
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the reload hook server did not start"
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/reload", root / "received"
    proc.kill()
    proc.wait()


def spec(source: Path, **kw) -> dict:
    out = {
        "kind": "continual",
        "sources": [str(source)],
        "replay_ratio": 0.25,
        "publish_every_steps": 2,
        "checkpoint_interval": 2,
        "heldout_every": 3,
        "eval_max_prompts": 2,
        "eval_max_new_tokens": 8,
        "poll_seconds": 0.1,
        "max_pending_records": 200,
    }
    out.update(kw)
    return out


def test_bad_continual_specs_name_the_field(daemon, tmp_path):
    source = daemon.data_dir / "bad-source"
    source.mkdir(exist_ok=True)
    post = lambda body: daemon.http.post("/jobs", json=body)  # noqa: E731
    assert "steps" in errors(post(spec(source, steps=3)))
    assert "replay_ratio" in errors(post(spec(source, replay_ratio=1)))
    assert "reload_url" in errors(post(spec(source, reload_url="ftp://host/x")))
    assert "sources[0]" in errors(post(spec(tmp_path)))  # outside the dataset roots
    # a missing source outside the output roots is not created: the client makes it
    from service.config import embedded_assets_dir  # a dataset root, not an output root

    missing = errors(post(spec(embedded_assets_dir() / "not-yet")))["sources[0]"]
    assert "does not exist" in missing and "create it first" in missing
    (source / "f.jsonl").write_text("")
    assert "sources[0]" in errors(post(spec(source / "f.jsonl")))  # not a directory
    assert "publish_dir" in errors(post(spec(source, publish_dir=str(tmp_path / "pub"))))
    assert "target_watch" in errors(post(spec(source, target_watch=str(tmp_path))))  # outside the roots
    assert "regenerate.temperature" in errors(post(spec(source, regenerate={"temperature": -1})))
    assert "regenerate.top_q" in errors(post(spec(source, regenerate={"top_q": 0.5})))
    assert "regenerate.max_new_tokens" in errors(post(spec(source, regenerate={"max_new_tokens": 10**5})))
    assert "publish_every_steps" in errors(post(spec(source, publish_every_steps=0)))
    assert "heldout_every" in errors(post(spec(source, heldout_every=1)))  # every record held out: no training
    secret = errors(post(spec(source, reload_url="http://user:secret@host/reload")))["reload_url"]
    assert "without credentials" in secret and "secret" not in secret
    # a source that would read the daemon's own files, or what the job itself writes
    assert "data directory" in errors(post(spec(daemon.data_dir)))["sources[0]"]
    for writes in ({"output_dir": str(source)}, {"publish_dir": str(source / "pub")}):
        assert "read what it writes" in errors(post(spec(source, **writes)))["sources[0]"], writes


def test_continual_job_trains_publishes_yields_and_survives_a_kill(daemon, reload_hook):
    hook_url, received = reload_hook
    http = daemon.http
    source = daemon.data_dir / "rollouts"
    source.mkdir()
    write_lines(source / "part-0001.jsonl", [conversation(i) for i in range(30)])
    job = daemon.submit(spec(source, reload_url=hook_url, name="keeps-up"))
    job_id = job["id"]

    # trains on what the source holds, and publishes v000001 (the first candidate always wins)
    published = daemon.wait_job(job_id, lambda j: "published" in j, timeout=180)["published"]
    assert published["version"] == 1 and published["tau"] >= 1.0
    publish_dir = Path(daemon.job(job_id)["output_dir"]) / "published"
    assert (publish_dir / "latest").is_symlink() and (publish_dir / "latest").resolve().name == "v000001"
    version_dir = publish_dir / "v000001"
    config = json.loads((version_dir / "config.json").read_text())
    assert config["dflash_target"]["config_sha256"] and config["architectures"]
    assert (version_dir / "model.safetensors").is_file()
    versions = json.loads((publish_dir / "versions.json").read_text())
    assert versions[0]["version"] == 1 and versions[0]["target"] == config["dflash_target"]
    assert {"step", "tau", "time"} <= set(versions[0])
    hook_calls = [c for c in received.read_text().splitlines() if c.startswith("/reload ")]
    assert hook_calls
    assert json.loads(hook_calls[0].split(" ", 1)[1])["version"] == 1
    events = daemon.events(job_id, kind="publish")
    assert events and events[0]["version"] == 1 and events[0]["reload"]["status"] == 200

    # the ingest route: bad lines are named, a prompt needs regenerate, nothing of a bad body is kept
    records = "\n".join(json.dumps(conversation(100 + i)) for i in range(12)).encode()
    ndjson = {"Content-Type": "application/x-ndjson"}
    bad = http.post(f"/jobs/{job_id}/records", content=records + b'\n{"messages": 3}\n', headers=ndjson)
    assert "line 13" in errors(bad) and bad.json()["detail"].startswith("invalid records: line 13")
    assert (
        "regenerate"
        in errors(http.post(f"/jobs/{job_id}/records", content=b'{"prompt": "hi"}\n', headers=ndjson))["line 1"]
    )
    assert http.post("/jobs/job-nope/records", content=records, headers=ndjson).status_code == 404
    # more lines than the job may ever hold: refused for good (422 naming the bound), not a 429
    too_many = "\n".join(json.dumps(conversation(i)) for i in range(201)).encode()
    never = http.post(f"/jobs/{job_id}/records", content=too_many, headers=ndjson)
    assert never.status_code == 422 and "max_pending_records" in errors(never)["body"], never.text
    # so `feed` sends at most that many a request
    with DaemonClient(daemon.url) as client:
        assert _batch_lines(client, argparse.Namespace(job_id=job_id, batch=1000)) == 200
        assert _batch_lines(client, argparse.Namespace(job_id=job_id, batch=16)) == 16
    r = http.post(f"/jobs/{job_id}/records", content=records, headers=ndjson)
    assert r.status_code == 202 and r.json() == {"accepted": 12}

    # the records are trained; then, with nothing new, the job idles (no step while it waits)
    def ingested(j):
        metrics = http.get("/metrics").text
        line = next(
            (ln for ln in metrics.splitlines() if ln.startswith(f'dflash_records_ingested_total{{job_id="{job_id}"}}')),
            "x 0",
        )
        return float(line.split()[-1]) >= 30 + 12 - 1

    daemon.wait_job(job_id, ingested, timeout=120)
    metrics = http.get("/metrics").text
    assert f'dflash_published_version{{job_id="{job_id}"}}' in metrics
    assert f'dflash_candidate_acceptance_length{{job_id="{job_id}"}}' in metrics
    assert f'dflash_records_pending{{job_id="{job_id}"}}' in metrics
    idle = daemon.wait_job(job_id, lambda j: j["state"] == "RUNNING")["progress"]["step"]
    time.sleep(1.0)
    idle_again = daemon.job(job_id)["progress"]["step"]
    time.sleep(1.0)
    assert daemon.job(job_id)["progress"]["step"] == idle_again <= idle + 4

    # a full buffer: 429 with Retry-After (the job trains 200 records in far more than a request's time)
    a_full_buffer = "\n".join(json.dumps(conversation(500 + i)) for i in range(200)).encode()
    assert http.post(f"/jobs/{job_id}/records", content=a_full_buffer, headers=ndjson).status_code == 202
    full = http.post(f"/jobs/{job_id}/records", content=a_full_buffer, headers=ndjson)
    assert full.status_code == 429 and int(full.headers["Retry-After"]) > 0

    # a queued job does not wait behind it: the continual job yields, the other runs, it resumes
    other = daemon.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2})
    assert daemon.wait_terminal(other["id"], timeout=120)["state"] == "SUCCEEDED"
    daemon.wait_job(job_id, lambda j: j["state"] == "RUNNING", timeout=60)
    states = [e for e in daemon.events(job_id, kind="state") if e.get("reason", "").startswith("yielded")]
    assert states, daemon.events(job_id, kind="state")

    # lines appended to the watched file are trained after the resume
    before = daemon.job(job_id)["progress"]["step"]
    write_lines(source / "part-0001.jsonl", [conversation(200 + i) for i in range(20)])
    daemon.wait_job(job_id, lambda j: j["progress"]["step"] > before, timeout=120)

    # accepted records survive a SIGKILL: in the spool, and trained after the restart
    r = http.post(f"/jobs/{job_id}/records", content=records, headers=ndjson)
    assert r.status_code == 202
    daemon.kill()
    spool = Path(job["output_dir"]) / "records" / "ingested-000001.jsonl"
    assert len(spool.read_text().splitlines()) == 12 + 200 + 12
    daemon.start()
    daemon.wait_ready()
    daemon.wait_job(job_id, lambda j: j["state"] == "RUNNING" and j["resumes"] >= 1, timeout=120)

    # cancel: STOPPED, and the published version stays
    assert http.post(f"/jobs/{job_id}/cancel").status_code == 202
    stopped = daemon.wait_terminal(job_id, timeout=120)
    assert stopped["state"] == "STOPPED" and stopped["published"]["version"] >= 1
    assert (publish_dir / "latest").resolve().is_dir()
    assert http.post(f"/jobs/{job_id}/records", content=records, headers=ndjson).status_code == 409
    # resumable as a training job is: it continues from its newest checkpoint, its versions numbered on
    last = stopped["progress"]["last_checkpoint_step"]
    assert http.post(f"/jobs/{job_id}/resume").status_code == 202
    resumed = daemon.wait_job(job_id, lambda j: j["state"] == "RUNNING" and j["progress"]["step"] >= last)
    assert resumed["published"]["version"] == stopped["published"]["version"]
    assert http.post(f"/jobs/{job_id}/cancel").status_code == 202
    assert daemon.wait_terminal(job_id)["state"] == "STOPPED"


def test_the_cli_starts_feeds_and_shows_a_continual_job(daemon, tmp_path):
    """Also: a source named before its writer made it (relative to the data dir, under the output
    roots) is created by the job, and what the job says about it names it as given."""
    from tests.service.test_cli import cli

    source = daemon.data_dir / "serving-log"
    assert not source.exists()
    started = cli(
        "continual", "serving-log", "--publish-every", "2", "--replay-ratio", "0.25", "--name", "from-cli",
        "--no-yield", url=daemon.url,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.split()[0]
    daemon.wait_job(job_id, lambda j: daemon.events(job_id, kind="source_created"), timeout=60)
    assert [e["source"] for e in daemon.events(job_id, kind="source_created")] == ["serving-log"]
    assert source.is_dir()
    write_lines(source / "log.jsonl", [conversation(290), {"messages": 3}])  # the second line is no conversation
    daemon.wait_job(job_id, lambda j: daemon.events(job_id, kind="skipped_records"), timeout=60)
    first = daemon.events(job_id, kind="skipped_records")[0]["first"]
    assert first[0].startswith("serving-log/log.jsonl:2") and str(daemon.data_dir) not in json.dumps(first), first
    records = tmp_path / "records.jsonl"
    write_lines(records, [conversation(300 + i) for i in range(40)], mode="w")
    fed = cli("feed", job_id, str(records), "--batch", "16", url=daemon.url)
    assert fed.returncode == 0 and "40 records accepted" in fed.stdout, fed.stderr
    # a bad record is named by the file's line, blank lines and earlier batches counted
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(conversation(400)), "", "", json.dumps(conversation(401)), '{"x": 1}']) + "\n")
    refused = cli("feed", job_id, str(bad), "--batch", "1", url=daemon.url)
    assert refused.returncode == 2 and f"{bad}:5: " in refused.stderr, refused.stderr
    assert "2 records accepted before" in refused.stderr
    daemon.wait_job(job_id, lambda j: "published" in j, timeout=120)
    shown = cli("published", job_id, url=daemon.url)
    assert shown.returncode == 0 and "published v000001" in shown.stdout, shown.stdout
    assert "from-cli" in cli("status", url=daemon.url).stdout
    # yield_to_queue off: a queued job waits until the continual job is cancelled
    queued = daemon.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2})
    time.sleep(1.5)
    assert daemon.job(queued["id"])["state"] == "PENDING" and daemon.job(job_id)["state"] == "RUNNING"
    assert cli("cancel", job_id, url=daemon.url).returncode == 0
    assert daemon.wait_terminal(job_id)["state"] == "STOPPED"
    assert daemon.wait_terminal(queued["id"])["state"] == "SUCCEEDED"
    # the example job file works as it is (its source, `rollouts`, under the data dir)
    example = json.loads((Path(__file__).resolve().parents[2] / "examples" / "continual-job.json").read_text())
    started = daemon.submit(example)
    daemon.wait_job(started["id"], lambda j: j["state"] == "RUNNING" and (daemon.data_dir / "rollouts").is_dir())
    assert cli("cancel", started["id"], url=daemon.url).returncode == 0
    assert daemon.wait_terminal(started["id"])["state"] == "STOPPED"


def _target_version(daemon, watch: Path, name: str, change) -> None:
    """A copy of the daemon's target under watch/name, its tensors changed by change(name, tensor);
    written under a hidden name and renamed, as a trainer saving a policy would."""
    import shutil

    from safetensors.torch import load_file, save_file

    original = next((daemon.data_dir / "defaults").glob("*/target"))
    tmp = watch / f".{name}"
    shutil.copytree(original, tmp)
    weights = load_file(str(tmp / "model.safetensors"))
    save_file({k: change(k, v) for k, v in weights.items()}, str(tmp / "model.safetensors"))
    tmp.rename(watch / name)


def test_a_new_target_version_is_swapped_in_place_and_another_shape_refused(daemon):
    source, watch = daemon.data_dir / "policy-rollouts", daemon.data_dir / "policy"
    source.mkdir()
    watch.mkdir()
    write_lines(source / "rollouts.jsonl", [conversation(500 + i) for i in range(30)])
    job_id = daemon.submit(spec(source, target_watch=str(watch)))["id"]
    daemon.wait_job(job_id, lambda j: "published" in j, timeout=120)
    _target_version(daemon, watch, "step-0100", lambda k, v: v * 1.01 if v.is_floating_point() else v)

    def swaps(_job=None):
        return daemon.events(job_id, kind="target_swap")

    swapped = daemon.wait_job(job_id, lambda j: bool(swaps(j)), timeout=60)
    event = swaps(swapped)[0]
    assert event["version"] == "step-0100" and not event["refused"] and event["seconds"] >= 0
    assert event["target"]["config_sha256"]
    _target_version(daemon, watch, "step-0200", lambda k, v: v[:-1] if k == "model.norm.weight" else v)
    daemon.wait_job(job_id, lambda j: len(swaps(j)) >= 2, timeout=60)
    refused = swaps(None)[1]
    assert refused["version"] == "step-0200" and refused["refused"] and "model.norm.weight" in refused["reason"]
    before = daemon.job(job_id)["progress"]["step"]
    write_lines(source / "rollouts.jsonl", [conversation(600 + i) for i in range(20)])
    daemon.wait_job(job_id, lambda j: j["progress"]["step"] > before, timeout=60)  # trains on with the new target
    metrics = daemon.http.get("/metrics").text
    assert f'dflash_target_swaps_total{{job_id="{job_id}"}} 1.0' in metrics
    assert f'dflash_target_swap_seconds_count{{job_id="{job_id}"}} 1.0' in metrics
    assert daemon.events(job_id, kind="drift")
    assert daemon.http.post(f"/jobs/{job_id}/cancel").status_code == 202
    assert daemon.wait_terminal(job_id)["state"] == "STOPPED"


def test_prompt_only_records_are_answered_by_the_target_then_trained(daemon):
    source = daemon.data_dir / "prompts-only"
    source.mkdir()
    job_id = daemon.submit(spec(source, regenerate={"max_new_tokens": 8, "slots": 4}))["id"]
    daemon.wait_job(job_id, lambda j: j["state"] == "RUNNING")
    prompts = [{"prompt": f"What is {i} plus {i}?"} for i in range(24)]
    body = "\n".join(json.dumps(p) for p in prompts).encode()
    r = daemon.http.post(f"/jobs/{job_id}/records", content=body, headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 202 and r.json() == {"accepted": 24}
    daemon.wait_job(job_id, lambda j: j["progress"]["step"] >= 1, timeout=120)  # answered, then trained
    report = daemon.wait_job(job_id, lambda j: bool(daemon.events(job_id, kind="regenerate")), timeout=60)
    assert report["state"] == "RUNNING"
    split = daemon.events(job_id, kind="regenerate")[0]
    assert split["answered"] >= 1 and split["answer_seconds"] > 0 and "train_seconds" in split
    assert daemon.http.post(f"/jobs/{job_id}/cancel").status_code == 202
    assert daemon.wait_terminal(job_id)["state"] == "STOPPED"
