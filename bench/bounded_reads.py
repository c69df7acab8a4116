"""What refusing unbounded input costs the daemon, and how fast a cancel reaches tokenizer workers.

1. A real daemon (CPU, embedded default) is sent POST /jobs naming a 1 GiB sparse file with no
   newline, with and without skip_bad_lines: its peak RSS growth (VmHWM after clear_refs) and the
   answer's time.
2. prepare_corpus with 2 spawned workers on a ~10 MiB JSONL: the seconds from should_stop turning
   true to prepare_corpus returning, and whether the workers are gone.

    PYTHONPATH=$PWD .venv/bin/python -m bench.bounded_reads
"""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
import time
from pathlib import Path

from tests.service.harness import Daemon, write_config


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def refuse_sparse_file(root: Path) -> None:
    (root / "cwd").mkdir()
    daemon = Daemon(write_config(root / "dflash.toml", root / "data"), root / "data", root / "cwd").start()
    try:
        daemon.wait_ready()
        sparse = root / "data" / "sparse.jsonl"
        with sparse.open("wb") as f:
            f.truncate(1 << 30)
        pid = daemon.proc.pid
        for skip in (False, True):
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            before = _kib(pid, "VmRSS")
            t = time.monotonic()
            r = daemon.http.post("/jobs", json={"datasets": [str(sparse)], "steps": 1, "skip_bad_lines": skip})
            print(
                f"1 GiB newline-free file, skip_bad_lines={skip}: HTTP {r.status_code} in {time.monotonic() - t:.2f} s; "
                f"RSS {before / 1024:.0f} MiB before, peak growth {(_kib(pid, 'VmHWM') - before) / 1024:.1f} MiB"
            )
    finally:
        daemon.close()


def cancel_latency(root: Path) -> None:
    from transformers import AutoTokenizer

    from dflash_core.data import prepare
    from dflash_core.data.prepare import Tokenization, prepare_corpus, save_tokenizer
    from dflash_core.data.tokenize import ChatTemplate
    from dflash_core.defaults import ensure_default_assets

    assets = ensure_default_assets(root / "assets")
    directory, digest = save_tokenizer(AutoTokenizer.from_pretrained(str(assets.target)), root / "cache")
    tok = Tokenization(str(directory), digest, ChatTemplate(), 512)
    block = assets.train.read_bytes()
    path = root / "big.jsonl"
    with path.open("wb") as f:
        for _ in range((10 << 20) // len(block) + 1):
            f.write(block)
    prepare.IN_PROCESS_BYTES = 0
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: _swallow(
            lambda: prepare_corpus([str(path)], tok, root / "cache", workers=2, should_stop=stop.is_set)
        )
    )
    thread.start()
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.1)
    time.sleep(3)
    t = time.monotonic()
    stop.set()
    thread.join()
    took = time.monotonic() - t
    time.sleep(0.5)
    left = [p for p in multiprocessing.active_children() if "resource_tracker" not in p.name]
    print(
        f"cancel during tokenization (2 workers): prepare_corpus returned {took:.2f} s after the stop; "
        f"workers left: {len(left)}"
    )


def _swallow(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the expected PrepareCancelled
        print(f"  ({type(e).__name__})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as a:
        refuse_sparse_file(Path(a))
    with tempfile.TemporaryDirectory() as b:
        cancel_latency(Path(b))
