"""Bad arguments and files given to the CLI end in one line naming what is wrong and exit 2 (1
for a failed export), never a traceback, a hang, a request to another route or a silent success.
The commands run in this process through service.cli.main, the CLI's own entry point; those that
need an answer get one from a real daemon."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from service.cli import main
from service.config import ConfigError, load_config
from tests.helpers import random_drafter, tiny_drafter_config

CLOSED = "http://127.0.0.1:9"  # nothing listens there


def run(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `dflash-trainer ARGV`; argparse's refusals included (code 2)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    out = {
        "array.json": "[1, 2]",
        "null.json": "null",
        "nan.json": '{"datasets": ["builtin://train"], "steps": 2, "learning_rate": NaN}',
        "huge.json": '{"datasets": ["builtin://train"], "steps": 2, "learning_rate": 1e999}',
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "broken.json": '{"datasets": [\n  "a",\n  }',
    }
    paths = {name: tmp_path / name for name in out}
    for name, text in out.items():
        paths[name].write_text(text)
    paths["binary.json"] = tmp_path / "binary.json"
    paths["binary.json"].write_bytes(b"\xff\xfe\x00{")
    paths["dir.json"] = tmp_path / "dir.json"
    paths["dir.json"].mkdir()
    return paths


def test_a_job_file_that_is_no_json_object_is_named(capsys, files):
    expected = {
        "array.json": "not an array",
        "null.json": "not null",
        "nan.json": "NaN is not JSON",
        "huge.json": "1e999 is out of range",
        "deep.json": "nested too deep",
        "broken.json": "broken.json:3:3: not valid JSON",
        "binary.json": "not UTF-8",
        "dir.json": "a directory",
    }
    for name, words in expected.items():
        # --name and --submission-id go into the spec: a file that is no object must not reach them
        for argv in (
            ("submit", str(files[name]), "--name", "x", "--submission-id", "y"),
            ("continual", "--job-file", str(files[name])),
        ):
            code, err = run(capsys, *argv, "--url", CLOSED)
            assert code == 2 and str(files[name].name) in err and words in err, (argv, err)


def test_options_that_json_cannot_carry_are_refused(capsys, tmp_path):
    for option in ("--margin", "--replay-ratio"):
        for value in ("nan", "inf", "-inf", "x"):
            code, err = run(capsys, "continual", "--url", CLOSED, f"{option}={value}")
            assert code == 2 and "not a finite number" in err, (option, value, err)
    records = tmp_path / "records.jsonl"
    records.write_text('{"messages": []}\n')
    for batch in ("0", "-5"):
        code, err = run(capsys, "feed", "job-x", str(records), "--batch", batch, "--url", CLOSED)
        assert code == 2 and "not a positive integer" in err


def test_a_records_file_without_records_is_refused_before_any_request(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    code, err = run(capsys, "feed", "job-x", str(empty), "--url", CLOSED)
    assert code == 2 and "empty.jsonl: no records" in err  # not "0 records accepted"
    code, err = run(capsys, "feed", "job-x", str(tmp_path), "--url", CLOSED)
    assert code == 2 and "a directory" in err
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    code, err = run(capsys, "feed", "job-x", str(fifo), "--url", CLOSED)  # not opened: no writer would come
    assert code == 2 and "not a regular file" in err


def test_urls_tokens_and_ids_no_request_can_carry(capsys):
    for url in ("http://[::1", "http://127.0.0.1:abc"):
        code, err = run(capsys, "status", "--url", url)
        assert code == 2 and "--url" in err, (url, err)
    code, err = run(capsys, "status", "--url", CLOSED, "--token", "a\nb")
    assert code == 2 and "--token" in err  # not "cannot reach the daemon"
    for job_id in ("", ".", "..", "j" * 300):
        code, err = run(capsys, "status", job_id, "--url", CLOSED)
        assert code == 2 and "not a job id" in err, (job_id, err)
    code, err = run(capsys, "cancel", "job-\x1b[2J", "--url", CLOSED)
    assert code == 4, err  # escaped into the path: a request that finds no daemon


def test_following_a_daemon_that_never_answered_ends_at_once(capsys):
    began = time.monotonic()
    code, err = run(capsys, "logs", "job-x", "--follow", "--url", CLOSED)
    assert code == 4 and "cannot reach the daemon" in err
    assert time.monotonic() - began < 10  # not the reconnect window a restarted daemon gets


@pytest.mark.slow  # the module's daemon
def test_a_job_id_stays_one_path_segment(capsys, daemon):
    job = daemon.submit({"datasets": ["builtin://train"], "steps": 2, "checkpoint_interval": 2})
    daemon.wait_terminal(job["id"])
    for job_id in ("../healthz", "../metrics", "?x", f"{job['id']}/cancel#", "..%2Fhealthz"):
        code, err = run(capsys, "status", job_id, "--url", daemon.url)
        assert code == 2 and "404" in err, (job_id, err)
    # resume of "<id>/cancel#" must not cancel or resume the job: no such job
    code, err = run(capsys, "resume", f"{job['id']}/cancel#", "--url", daemon.url)
    assert code == 2 and "404" in err
    assert daemon.job(job["id"])["cancel_requested"] is False


class _NotTheDaemon(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html>a proxy's page</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_that_is_not_the_daemon_is_said_to_be(capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotTheDaemon)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for argv in (("status",), ("status", "job-x"), ("logs", "job-x"), ("logs", "job-x", "--follow")):
            code, err = run(capsys, *argv, "--url", url)
            assert code == 5 and "not the daemon's JSON" in err, (argv, err)
    finally:
        server.shutdown()
        server.server_close()


def _checkpoint(tmp_path: Path) -> Path:
    from dflash_core.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path / "good", random_drafter(tiny_drafter_config(layers=1), seed=1).float())


def test_a_damaged_checkpoint_is_named_by_export_and_eval(capsys, tmp_path):
    good = _checkpoint(tmp_path)
    config = json.loads((good / "config.json").read_text())
    damaged = {
        "empty config": ("config.json", "{}", "no 'hidden_size'"),
        "array config": ("config.json", "[]", "not a drafter config"),
        "text config": ("config.json", "not json", "config.json: not valid JSON"),
        "string size": ("config.json", json.dumps({**config, "hidden_size": "big"}), "hidden_size is 'big'"),
        "metadata": ("dflash_metadata.json", "[", "dflash_metadata.json: not valid JSON"),
        "weights": ("model.safetensors", "garbage", "not a readable safetensors file"),
    }
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    for case, (name, text, words) in damaged.items():
        broken = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, broken)
        (broken / name).write_text(text)
        code, err = run(capsys, "export", str(broken), str(tmp_path / f"out-{broken.name}"))
        assert code == 1 and words in err, (case, err)
        assert not (tmp_path / f"out-{broken.name}").exists()
    code, err = run(
        capsys, "eval", "--checkpoint", str(tmp_path / "weights"), "--prompts", str(prompts),
        "--data-dir", str(tmp_path / "data"),
    )  # fmt: skip
    assert code == 2 and "not a readable safetensors file" in err


def test_eval_refuses_what_it_cannot_evaluate_before_loading_anything(capsys, tmp_path):
    good = _checkpoint(tmp_path)
    prompts, empty = tmp_path / "prompts.jsonl", tmp_path / "empty.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    empty.write_text("")
    base = ("eval", "--checkpoint", str(good), "--data-dir", str(tmp_path / "data"))
    for device, words in (("garbage", "not a device name"), ("cuda:99", "cuda"), ("meta", "cpu and cuda")):
        code, err = run(capsys, *base, "--prompts", str(prompts), "--device", device)
        assert code == 2 and f"device {device!r}" in err and words in err, (device, err)
    for option in ("--max-prompts", "--max-new-tokens"):
        for value in ("0", "-1"):
            code, err = run(capsys, *base, "--prompts", str(prompts), option, value)
            assert code == 2 and "not a positive integer" in err
    code, err = run(capsys, *base, "--prompts", str(empty))
    assert code == 2 and "no conversations" in err  # not "tau = 0.000 over 0 blocks"


def test_config_files_and_data_dirs_that_cannot_be_used(tmp_path):
    cases = {
        "binary.toml": (b"port = \xff\n", "not UTF-8"),
        "twice.yaml": (b"port: 1\nport: 2\n", "given twice"),
        "deep.yaml": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deep"),
        "deep.toml": (b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deep"),
    }
    for name, (content, words) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=words):
            load_config(path, env={})
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for data_dir, words in (("", "an empty path"), ("  ", "an empty path"), (str(a_file), "is a file")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides={"data_dir": data_dir}, env={})
