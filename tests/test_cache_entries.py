"""Tokenization cache entries are verified: a corrupted entry is named, quarantined and rebuilt
(never trained on); an in-place edit that keeps size and mtime is noticed; partial entries and
tokenizer workers do not outlive a killed daemon; a cancel reaches the workers within 2 s.
Real files, real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_core.data.prepare import PrepareCancelled, Tokenization, prepare_corpus, save_tokenizer
from dflash_core.data.tokenize import ChatTemplate

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 512


@pytest.fixture(scope="module")
def records(default_assets) -> list[str]:
    return default_assets.train.read_text().splitlines()[:40]


@pytest.fixture(scope="module")
def tokenization(default_assets, tmp_path_factory) -> Tokenization:
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    directory, digest = save_tokenizer(tokenizer, tmp_path_factory.mktemp("tok"))
    return Tokenization(str(directory), digest, ChatTemplate(), SEQ_LEN)


def _documents(corpus) -> list[list[int]]:
    return [corpus.document(i)[0].tolist() for i in range(len(corpus))]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "empty tokens file": lambda d: (d / "tokens.i32").write_bytes(b""),
    "a flipped token byte": lambda d: _flip_a_byte(d / "tokens.i32"),
    "a flipped mask byte": lambda d: _flip_a_byte(d / "mask.u8"),
    "short lengths": lambda d: (d / "lengths.i64").write_bytes((d / "lengths.i64").read_bytes()[:-8]),
    "no positions": lambda d: (d / "positions.i64").unlink(),
    "no meta.json": lambda d: (d / "meta.json").unlink(),
    "garbage meta.json": lambda d: (d / "meta.json").write_text("{not json"),
    "deeply nested meta.json": lambda d: (d / "meta.json").write_text("[" * 100_000 + "]" * 100_000),
    "meta.json of an older layout": lambda d: (d / "meta.json").write_text(
        json.dumps({k: v for k, v in json.loads((d / "meta.json").read_text()).items() if k != "manifest"})
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_entry_is_quarantined_and_rebuilt(records, tokenization, tmp_path, corruption):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(records[:12]) + "\n")
    cache = tmp_path / "cache"
    good = _documents(prepare_corpus([str(path)], tokenization, cache))
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".") and p.name != "quarantine"]
    CORRUPTIONS[corruption](entry)
    seen = []
    again = prepare_corpus([str(path)], tokenization, cache, progress=seen.append, names={str(path): "given.jsonl"})
    assert _documents(again) == good
    assert seen[-1].files_cached == 0
    assert [(r["dataset"], r["entry"]) for r in seen[-1].rebuilt] == [("given.jsonl", entry.name)], seen[-1]
    assert len(list((cache / "quarantine").iterdir())) == 1
    seen = []
    prepare_corpus([str(path)], tokenization, cache, progress=seen.append)  # the rebuilt entry is used
    assert seen[-1].files_cached == 1 and seen[-1].rebuilt == []


def test_an_in_place_edit_with_size_and_mtime_kept_is_noticed(records, tokenization, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(records[:10]) + "\n")
    before = os.stat(path)
    first = _documents(prepare_corpus([str(path)], tokenization, tmp_path / "cache"))
    swapped = records[1:2] + records[0:1] + records[2:10]  # same bytes, other order: same size
    path.write_text("\n".join(swapped) + "\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    seen = []
    second = _documents(prepare_corpus([str(path)], tokenization, tmp_path / "cache", progress=seen.append))
    assert seen[-1].files_cached == 0
    assert second[0] == first[1] and second[1] == first[0]


def _big_dataset(records: list[str], path: Path, mib: int) -> Path:
    block = ("\n".join(records) + "\n").encode()
    with path.open("wb") as f:
        for _ in range((mib << 20) // len(block) + 1):
            f.write(block)
    return path


def _children(pid: int) -> list[int]:
    """The spawned worker processes of `pid` (not multiprocessing's resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in command:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_cancel_reaches_the_workers_within_2_seconds(records, tokenization, tmp_path):
    from dflash_core.data import prepare

    path = _big_dataset(records, tmp_path / "big.jsonl", 10)
    stop = threading.Event()
    outcome: list[BaseException | None] = []
    old = prepare.IN_PROCESS_BYTES
    prepare.IN_PROCESS_BYTES = 0  # read in the parent; the workers get whole 4 MiB chunks

    def run() -> None:
        try:
            prepare_corpus([str(path)], tokenization, tmp_path / "cache", workers=2, should_stop=stop.is_set)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while len(_children(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(os.getpid())
        assert len(workers) >= 2
        time.sleep(3)  # inside their first chunks
        t = time.monotonic()
        stop.set()
        thread.join(10)
        took = time.monotonic() - t
    finally:
        prepare.IN_PROCESS_BYTES = old
    assert isinstance(outcome[0], PrepareCancelled), outcome
    assert took < 2.0, took
    deadline = time.monotonic() + 5  # terminated workers are reaped by the pool's own thread
    while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)]
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]


SCRIPT = """
import sys
from dflash_core.data import prepare
from dflash_core.data.prepare import Tokenization, prepare_corpus
from dflash_core.data.tokenize import ChatTemplate
prepare.IN_PROCESS_BYTES = 0
tok = Tokenization(sys.argv[1], sys.argv[2], ChatTemplate(), 512)
prepare_corpus([sys.argv[3]], tok, __import__("pathlib").Path(sys.argv[4]), workers=2)
"""


@pytest.mark.slow
def test_a_killed_daemon_leaves_no_workers_and_its_partial_entry_is_swept(records, tokenization, tmp_path):
    path = _big_dataset(records, tmp_path / "big.jsonl", 10)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [tokenization.tokenizer_dir, tokenization.tokenizer_hash, str(path), str(cache)]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *args], env=env)
    try:
        deadline = time.monotonic() + 90
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        time.sleep(3)
        assert [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [w for w in workers if _alive(w)]
    for w in left:  # do not leave them to the next test either way
        os.kill(w, signal.SIGKILL)
    assert not left, "tokenizer workers outlived the killed daemon"
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(records[:5]) + "\n")
    prepare_corpus([str(small)], tokenization, cache)  # the next start sweeps what the killed one left
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_quarantined_copies_do_not_pile_up(records, tokenization, tmp_path):
    """A quarantined copy is as large as its entry: the next data preparation removes those set
    aside longer ago than the quarantine keeps them, and never keeps more than the newest few."""
    from dflash_core.data.cache_entry import QUARANTINE_KEEP, QUARANTINE_SECONDS

    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(records[:8]) + "\n")
    cache = tmp_path / "cache"
    place = cache / "quarantine"
    place.mkdir(parents=True)
    now = time.time_ns()
    old = [place / f"entry{i}-{now - int(2 * QUARANTINE_SECONDS * 1e9) - i}" for i in range(3)]
    recent = [place / f"entry{i}-{now - i * 1000}" for i in range(QUARANTINE_KEEP + 2)]
    for p in old + recent:
        p.mkdir()
        (p / "tokens.i32").write_bytes(b"\0" * 64)
    prepare_corpus([str(path)], tokenization, cache)
    assert sorted(p.name for p in place.iterdir()) == sorted(p.name for p in recent[:QUARANTINE_KEEP])
