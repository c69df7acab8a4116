"""A corrupted tokenization cache entry never trains a job on nothing: the daemon's next job on
that dataset reports the entry by name in its preparing_data event, rebuilds it and trains on
real tokens. Real daemon, real cache files."""

from __future__ import annotations

import json

import pytest

from dflash_core.defaults import ASSETS_VERSION


@pytest.mark.slow  # jobs on a real daemon, the dataset tokenized twice
def test_an_emptied_tokens_file_is_rebuilt_not_trained_on(daemon):
    d = daemon
    # a dataset file of this test's own: the cache entries of its path are this test's alone
    # (the daemon may hold entries of other modules' datasets)
    dataset = d.data_dir / "rebuilt-train.jsonl"
    dataset.write_text((d.data_dir / "defaults" / ASSETS_VERSION / "train.jsonl").read_text())
    first = d.submit({"datasets": [dataset.name], "steps": 2})
    assert d.wait_terminal(first["id"])["state"] == "SUCCEEDED"
    cache = d.data_dir / "cache" / "tokens"
    entries = [
        p
        for p in cache.iterdir()
        if (p / "tokens.i32").is_file() and json.loads((p / "meta.json").read_text())["source"] == str(dataset)
    ]
    assert entries
    for entry in entries:
        (entry / "tokens.i32").write_bytes(b"")  # as a torn write or a full disk would leave it
    second = d.submit({"datasets": [dataset.name], "steps": 2})
    ended = d.wait_terminal(second["id"])
    assert ended["state"] == "SUCCEEDED", ended
    progress = [e for e in d.events(second["id"]) if e["kind"] == "preparing_data" and e.get("done")]
    rebuilt = progress[-1]["rebuilt_cache_entries"]
    assert {r["entry"] for r in rebuilt} == {e.name for e in entries}, progress[-1]
    assert all("tokens.i32" in r["reason"] and r["dataset"] == dataset.name for r in rebuilt), rebuilt
    steps = [e for e in d.events(second["id"]) if e["kind"] == "step"]
    assert steps and all(s["labels"] > 0 and s["loss"] > 0 for s in steps), steps
    quarantined = [p for p in (cache / "quarantine").iterdir() if p.name.rsplit("-", 1)[0] in {e.name for e in entries}]
    assert len(quarantined) == len(entries)
