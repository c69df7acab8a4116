"""Regeneration jobs on the CPU engine (the embedded target): prompts from every dataset layout,
complete shards only after a cancel, a resumed sampled run equal to an uninterrupted one, no shard
written twice, another plan refused, bad records failing with their place or counted and skipped."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data.regenerated import MANIFEST
from dflash_core.engine import Engine, JobCallbacks, JobError
from dflash_core.regenerate.job import RegenerateJob
from tests.test_engine import engine_config

SYSTEM = {"role": "system", "content": "you are a helpful assistant ."}


@pytest.fixture(scope="module")
def engine(default_assets):
    return Engine(engine_config(["cpu"]), default_assets.root.parent.parent).build()


@pytest.fixture(scope="module")
def prompts(default_assets):
    """Eight held-out conversations."""
    with open(default_assets.heldout) as f:
        return [json.loads(line)["messages"] for line in list(f)[:8]]


class Recorder(JobCallbacks):
    def __init__(self, cancel_after_shards: int | None = None):
        self.checkpoints, self.events, self.progress = [], [], []
        self.cancel_after = cancel_after_shards

    def on_checkpoint(self, path, step, pause_seconds=0.0):
        self.checkpoints.append((path, step))

    def on_event(self, kind, payload):
        self.events.append((kind, payload))

    def on_generate(self, progress):
        self.progress.append(progress)

    def should_cancel(self):
        return self.cancel_after is not None and len(self.checkpoints) >= self.cancel_after


def _job(datasets, out, **kw):
    values = dict(datasets=[str(d) for d in datasets], output_dir=str(out), max_new_tokens=12, shard_rows=3)
    values.update(kw)
    return RegenerateJob(**values)


def _rows(out):
    manifest = json.loads((out / MANIFEST).read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += pq.read_table(out / shard["file"]).to_pylist()
    return manifest, rows


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_layouts(engine, prompts, tmp_path):
    """A `prompt` column in parquet, ShareGPT conversations in a JSON array, OpenAI messages in a
    save_to_disk directory: each conversation is cut after its last user turn."""
    import datasets

    questions = [next(m["content"] for m in conv if m["role"] == "user") for conv in prompts[:3]]
    pq.write_table(pa.table({"prompt": questions}), tmp_path / "prompts.parquet")
    sharegpt = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old answer"}]} for q in questions
    ]
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt))
    datasets.Dataset.from_list([{"messages": conv} for conv in prompts[3:5]]).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "out"
    sources = [tmp_path / "prompts.parquet", tmp_path / "sharegpt.json", tmp_path / "hf"]
    result = engine.run_job(_job(sources, out, samples_per_prompt=2), Recorder())
    assert result.status == "SUCCEEDED" and result.steps_done == result.total_steps == 16
    manifest, rows = _rows(out)
    assert manifest["complete"] and manifest["counts"]["rows"] == 16 and len(manifest["plan"]["sources"]) == 3
    for row in rows:
        *asked, answer = row["messages"]
        assert asked[-1]["role"] == "user" and answer["role"] == "assistant"
        assert "old answer" not in json.dumps(asked)
    # every path the output records is relative to the output directory, none the host's
    recorded = (out / MANIFEST).read_text() + json.dumps([r["source"] for r in rows])
    assert str(tmp_path) not in recorded, recorded[:2000]
    assert [s["dataset"] for s in manifest["plan"]["sources"]] == ["../prompts.parquet", "../sharegpt.json", "../hf"]
    # the target named by the identity a checkpoint trained on the output records
    from dflash_core.target_identity import target_identity

    assert manifest["plan"]["target"] == target_identity(engine.parts.target_path)
    parquet_rows = [r for r in rows if r["source"].startswith("../prompts.parquet")]
    assert sorted(r["messages"][0]["content"] for r in parquet_rows) == sorted(questions * 2)
    # greedy: the two samples of a prompt agree
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["source"], set()).add(r["messages"][-1]["content"])
    assert all(len(answers) == 1 for answers in by_prompt.values())


@pytest.mark.slow
def test_cancel_keeps_complete_shards_and_a_resumed_sampled_run_equals_an_uninterrupted_one(engine, prompts, tmp_path):
    data = _write_jsonl(tmp_path / "p.jsonl", [{"messages": conv} for conv in prompts])
    sampled = dict(temperature=1.0, top_p=0.95, seed=5, samples_per_prompt=2)
    whole = tmp_path / "whole"
    engine.run_job(_job([data], whole, **sampled), Recorder())
    _, expected = _rows(whole)

    out = tmp_path / "cut"
    stopped = engine.run_job(_job([data], out, **sampled), Recorder(cancel_after_shards=1))
    assert stopped.status == "STOPPED"
    manifest, rows = _rows(out)
    assert not manifest["complete"] and 1 <= len(manifest["shards"]) < 6
    # only the manifest and the shards it lists: nothing half written
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [s["file"] for s in manifest["shards"]])
    written = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in manifest["shards"]}

    rec = Recorder()
    resumed = engine.run_job(_job([data], out, **sampled), rec, resume_from=str(out))
    assert resumed.status == "SUCCEEDED"
    assert ("prompts", {"prompts": 8, "rows": 16, "skipped_lines": 0, "shards": 6, "shards_done": len(written)}) in (
        rec.events
    )
    manifest, rows = _rows(out)
    assert manifest["complete"] and len(rows) == 16
    assert {f: (out / f).stat().st_mtime_ns for f in written} == written  # not written again

    def key(r):
        return (r["source"], r["sample"])

    assert sorted(rows, key=key) == sorted(expected, key=key)
    assert len({r["messages"][-1]["content"] for r in rows}) > 8  # the samples differ
    final = rec.progress[-1]
    assert final["rows_done"] == final["rows_total"] == 16 and final["prompts_total"] == 8

    # another plan in the same directory is refused, naming the field
    with pytest.raises(JobError) as e:
        engine.run_job(_job([data], out, **{**sampled, "seed": 6}), Recorder())
    assert e.value.field == "output_dir" and "sampling" in e.value.message


def test_bad_records_fail_with_their_place_or_are_skipped(engine, prompts, tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["apple"] * 400)}]}
    no_user = {"messages": [SYSTEM]}
    data = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": prompts[0]}, long_prompt, no_user, {"prompt": "hi"}])
    with pytest.raises(JobError) as e:
        engine.run_job(_job([data], tmp_path / "a"), Recorder())
    assert "bad.jsonl:2" in e.value.message and "generation length" in e.value.message
    rec = Recorder()
    result = engine.run_job(_job([data], tmp_path / "b", skip_bad_lines=True), rec)
    assert result.status == "SUCCEEDED" and result.skipped_lines == 2 and result.total_steps == 2
    skipped = dict(rec.events)["skipped_lines"]
    assert skipped["count"] == 2 and "bad.jsonl:3" in skipped["first"][1]

    empty = _write_jsonl(tmp_path / "none.jsonl", [no_user])
    with pytest.raises(JobError) as e:
        engine.run_job(_job([empty], tmp_path / "c", skip_bad_lines=True), Recorder())
    assert e.value.field == "datasets"


def test_shapes_beyond_the_engine_are_refused(engine, default_assets, tmp_path):
    with pytest.raises(JobError) as e:
        engine.validate_job(_job([default_assets.heldout], tmp_path, max_new_tokens=engine.config.seq_len))
    assert e.value.field == "max_new_tokens"
    with pytest.raises(JobError) as e:
        engine.validate_job(_job([default_assets.heldout], tmp_path, chat_template_kwargs={"x": 1}, kind="distill"))
    assert e.value.field == "kind"


@pytest.mark.slow
def test_a_full_disk_fails_the_job_before_a_shard_and_a_rerun_completes(engine, prompts, tmp_path):
    """The disk fills after the first shard: the job fails naming ENOSPC, leaves the manifest's
    complete shards only, and a rerun once there is room writes the rest."""
    from tests.helpers import mount_tmpfs, unmount

    data = _write_jsonl(tmp_path / "p.jsonl", [{"messages": conv} for conv in prompts])
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "size=4m")
    try:
        out = disk / "out"
        filler = disk / "filler"

        class FillAfterFirstShard(Recorder):
            def on_checkpoint(self, path, step, pause_seconds=0.0):
                super().on_checkpoint(path, step, pause_seconds)
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                            f.flush()
                    except OSError:
                        pass

        with pytest.raises(JobError) as e:
            engine.run_job(_job([data], out), FillAfterFirstShard())
        assert "ENOSPC" in e.value.message
        manifest, rows = _rows(out)
        assert len(manifest["shards"]) == 1 and len(rows) == manifest["shards"][0]["rows"] > 0
        assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, manifest["shards"][0]["file"]])
        filler.unlink()
        assert engine.run_job(_job([data], out), Recorder()).status == "SUCCEEDED"
        manifest, rows = _rows(out)
        assert manifest["complete"] and len({r["source"] for r in rows}) == len(rows) == 8
    finally:
        unmount(disk)
