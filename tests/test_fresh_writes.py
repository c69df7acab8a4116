"""Every file the daemon writes in an output directory others can write is created fresh: a
symlink planted under a temporary name of a regeneration, or under the name of a TensorBoard
event file, is never written through, and what lands in the output is a regular file."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pyarrow.parquet as pq
import pytest

from dflash_core.data.regenerated import MANIFEST
from dflash_core.engine.api import JobError
from dflash_core.regenerate.output import ShardOutput
from service.tracking import Tracker


def _row(text: str) -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
        "source": "prompts.jsonl:1",
        "sample": 0,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "finish_reason": "stop",
    }


def _world_writable(path):
    path.mkdir(parents=True)
    path.chmod(0o777)
    return path


def test_planted_regeneration_temp_names_are_not_followed(tmp_path):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    out = _world_writable(root / "R")
    output = ShardOutput(str(out), [str(root)])
    try:
        output.start({"plan": 1})
        # planted while the run goes on: the names a shard and the manifest are written under
        for name in (".tmp-shard-00005.parquet", f".tmp-{MANIFEST}", "shard-00006.parquet"):
            (outside / name).write_text("outside")
            (out / name).symlink_to(outside / name)
        output.write_shard(5, [_row("five")])
        output.write_shard(6, [_row("six")])
        output.finish()
    finally:
        output.close()
    assert all(p.read_text() == "outside" for p in outside.iterdir())
    for name in ("shard-00005.parquet", "shard-00006.parquet", MANIFEST):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert pq.read_table(out / "shard-00005.parquet").column("messages")[0][1]["content"].as_py() == "five"
    assert json.loads((out / MANIFEST).read_text())["complete"] is True
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-staging-")]


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_planted_manifest_is_not_followed_nor_waited_on(tmp_path, planted):
    """A regeneration continuing in an output directory reads its manifest back: a symlink or a
    FIFO planted there is refused at once (a FIFO would block the job worker for good)."""
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    out = _world_writable(root / "R")
    (outside / "m.json").write_text(json.dumps({"format": "dflash-regeneration", "plan": {"secret": "x"}}))
    if planted == "symlink":
        (out / MANIFEST).symlink_to(outside / "m.json")
    else:
        os.mkfifo(out / MANIFEST)
    output = ShardOutput(str(out), [str(root)])
    failure: list[BaseException] = []

    def start():
        try:
            output.start({"plan": 1})
        except BaseException as e:  # noqa: BLE001 - the test checks which
            failure.append(e)

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        with open(out / MANIFEST, "wb"):  # let the waiting reader go
            pass
        raise AssertionError("the job waited on a planted FIFO")
    output.close()
    assert failure and isinstance(failure[0], JobError), failure
    assert planted in str(failure[0]) or "regular file" in str(failure[0])
    assert "secret" not in str(failure[0])


def test_a_planted_event_file_name_is_not_followed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    outside.mkdir()
    board = _world_writable(root / "job" / "tensorboard")
    now = int(time.time())
    for t in range(now - 2, now + 30):  # every name tensorboardX would choose in the next seconds
        target = outside / f"f{t}"
        target.write_text("outside")
        (board / f"events.out.tfevents.{t}.{socket.gethostname()}").symlink_to(target)
    tracker = Tracker(["tensorboard"], job_id="job-1", name=None, output_dir=str(root / "job"), spec={}, roots=[root])
    assert not tracker.errors, tracker.errors
    tracker._log({"train/loss": 1.0}, 1)
    tracker.close()
    assert all(p.read_text() == "outside" for p in outside.iterdir())
    written = [p for p in board.rglob("*tfevents*") if not p.is_symlink()]
    assert len(written) == 1 and written[0].is_file() and written[0].stat().st_size > 0


def test_a_directory_of_another_user_is_not_taken_for_ours(tmp_path):
    """What a private directory is checked against when it was swapped between mkdir and open:
    one this process made passes, another user's (tests run as root: one chowned away) does not,
    nor one that already holds the probe's name."""
    from dflash_core.confine import made_by_us

    def check(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return made_by_us(fd)
        finally:
            os.close(fd)

    (tmp_path / "mine").mkdir()
    assert check(tmp_path / "mine") and not list((tmp_path / "mine").iterdir())
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", 4242, 4242)
    assert not check(tmp_path / "theirs")
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / ".owner-probe").symlink_to(tmp_path / "elsewhere")
    assert not check(tmp_path / "planted") and not (tmp_path / "elsewhere").exists()
