"""The parts of a continual job, without a daemon: the source watcher reads appended lines and
finished files (and nothing a writer is still writing), the record pool mixes new records with
replay at the engine's one shape and makes a reader wait when nothing is new, and the publisher
writes complete versions before `latest` moves, keeps the last few, and leaves the previous
version intact when a publish was killed half way."""

from __future__ import annotations

import json
import threading
import time
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.config import ShapeConfig
from dflash_core.continual.publish import LATEST, VERSIONS_FILE, Publisher
from dflash_core.continual.replay import ContinualStream, Doc, RecordPool, StreamStopped
from dflash_core.continual.sources import SourceWatcher
from dflash_core.data.conversations import Conversation
from dflash_core.data.errors import DatasetError
from tests.helpers import random_drafter, tiny_drafter_config


def conv(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def values(records) -> list:
    return [r.value for r in records]


def test_watcher_reads_appended_lines_and_finished_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    watcher = SourceWatcher([(src, "src", [str(tmp_path)])], None)
    assert values(watcher.poll()) == []
    log = src / "log.jsonl"
    log.write_text(json.dumps(conv(0)) + "\n" + json.dumps(conv(1))[:10])  # the second line still being written
    assert values(watcher.poll()) == [conv(0)]
    with log.open("a") as f:
        f.write(json.dumps(conv(1))[10:] + "\nnot json\n")
    got = list(watcher.poll())
    assert got[0].value == conv(1) and got[0].source == "src/log.jsonl:2"
    assert isinstance(got[1].value, DatasetError) and "log.jsonl:3" in str(got[1].value)
    (src / ".partial.parquet").write_bytes(b"a writer's temporary file")
    pq.write_table(pa.table({"messages": [conv(5)["messages"]]}), src / "shard.parquet")
    assert values(watcher.poll()) == []  # new: read once it held still over a poll
    assert values(watcher.poll()) == [{"messages": conv(5)["messages"]}]
    assert values(watcher.poll()) == []
    # a watcher started from the cursor reads on from there
    again = SourceWatcher([(src, "src", [str(tmp_path)])], watcher.cursor())
    with log.open("a") as f:
        f.write(json.dumps(conv(9)) + "\n")
    assert values(again.poll()) == [conv(9)]


def test_the_watchers_cursor_moves_record_by_record(tmp_path):
    """A line counts as read once the next record is asked for (the one before was handled), so
    a cursor read mid-poll never counts a line whose record is still in hand, and never misses
    one that is handled."""
    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps(conv(i)) + "\n" for i in range(3)]
    (src / "log.jsonl").write_text(lines[0] + "\n" + lines[1] + lines[2])  # a blank line between
    watcher = SourceWatcher([(src, "src", [str(tmp_path)])], None)
    records = watcher.poll()
    state = lambda: watcher.files[str(src / "log.jsonl")]  # noqa: E731
    assert next(records).value == conv(0) and state() == {"offset": 0, "line": 1}
    assert next(records).value == conv(1) and state() == {"offset": len(lines[0]), "line": 2}
    assert next(records).value == conv(2) and state() == {"offset": len(lines[0]) + 1 + len(lines[1]), "line": 4}
    assert next(records, None) is None and state() == {"offset": len("".join(lines)) + 1, "line": 5}


def test_watcher_lines_are_the_training_readers_lines(tmp_path):
    """A record with a bare carriage return (JSON whitespace) is one record and the next keeps
    its line number, and a line longer than one poll's read but within a record's bound is a
    record, as the JSONL reader of a training job takes them; a longer one is skipped, once."""
    from dflash_core.continual import sources
    from dflash_core.data.conversations import read_conversations

    src = tmp_path / "src"
    src.mkdir()
    long_answer = "x" * (sources.READ_BYTES_PER_POLL + 1000)
    with_cr = json.dumps(conv(0)).replace(", ", ",\r ")
    lines = [
        with_cr,
        json.dumps(conv(1)),
        json.dumps({"messages": [conv(2)["messages"][0], {"role": "assistant", "content": long_answer}]}),
    ]
    (src / "log.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    watcher = SourceWatcher([(src, "src", [str(tmp_path)])], None)
    got = list(watcher.poll()) + list(watcher.poll())  # a poll reads on to its last complete line
    assert [r.source for r in got] == ["src/log.jsonl:1", "src/log.jsonl:2", "src/log.jsonl:3"]
    assert [r.value for r in got[:2]] == [conv(0), conv(1)] and len(got[2].value["messages"][1]["content"]) == len(
        long_answer
    )
    assert len(list(read_conversations(src / "log.jsonl"))) == 3  # what a training job reads of the same file
    too_long = "y" * (sources.MAX_RECORD_BYTES + 10)
    with (src / "log.jsonl").open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": too_long}]}) + "\n" + json.dumps(conv(4)) + "\n")
    got = list(watcher.poll())
    assert isinstance(got[0].value, DatasetError) and got[0].source == "src/log.jsonl:4"
    assert [r.value for r in got[1:]] + [r.value for r in watcher.poll()] == [conv(4)]


def test_watcher_walks_a_tree_in_name_order_and_leaves_dot_names_and_linked_directories(tmp_path):
    """Files in subdirectories come in the order of their path's parts ("a/" before "a-b/",
    though "-" sorts before "/"), labelled by their path below the source; names starting with a
    dot (files and directories) and other suffixes are left alone, and a symlinked directory is
    not entered. A file read to its end is passed over at later polls, even once it is gone."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    for d in (src / "a", src / "a-b" / "deep", src / ".tmp", elsewhere):
        d.mkdir(parents=True)
    files = {"a-b/deep/z.jsonl": 3, "a/y.jsonl": 2, "a-b/x.jsonl": 4, "top.jsonl": 5, ".tmp/w.jsonl": 6}
    for name, i in {**files, "a/.part.jsonl": 7, "a/notes.txt": 8}.items():
        (src / name).write_text(json.dumps(conv(i)) + "\n")
    (elsewhere / "e.jsonl").write_text(json.dumps(conv(9)) + "\n")
    (src / "linked").symlink_to(elsewhere, target_is_directory=True)
    watcher = SourceWatcher([(src, "rollouts/", [str(tmp_path)])], None)
    got = list(watcher.poll())
    assert [r.source for r in got] == [
        "rollouts/a/y.jsonl:1",
        "rollouts/a-b/deep/z.jsonl:1",
        "rollouts/a-b/x.jsonl:1",
        "rollouts/top.jsonl:1",
    ]
    assert [r.value for r in got] == [conv(2), conv(3), conv(4), conv(5)]
    (src / "a" / "y.jsonl").unlink()
    (src / "top.jsonl").write_text(json.dumps(conv(5)) + "\n" + json.dumps(conv(10)) + "\n")
    assert [(r.source, r.value) for r in watcher.poll()] == [("rollouts/top.jsonl:2", conv(10))]


def test_watcher_refuses_a_file_that_leads_outside_the_roots(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps(conv(0)) + "\n")
    (src / "link.jsonl").symlink_to(outside / "secret.jsonl")
    watcher = SourceWatcher([(src, "src", [str(src)])], None)
    got = list(watcher.poll())
    assert len(got) == 1 and isinstance(got[0].value, DatasetError) and "outside" in str(got[0].value)
    assert list(watcher.poll()) == []  # reported once, not again at every poll


def doc(n: int, fill: int = 5) -> Doc:
    return Doc(np.full(n, fill, dtype=np.int64), np.ones(n, dtype=bool))


def test_pool_mixes_new_records_with_replay_at_one_shape():
    shape = ShapeConfig(seq_len=64, num_anchors=4, block_size=4)
    pool = RecordPool(shape.seq_len, replay_capacity=4, heldout_capacity=2, heldout_every=3)
    for i in range(12):
        pool.add(Conversation(conv(i)["messages"], f"s:{i}"), doc(8, fill=i + 2))
    assert len(pool.heldout_window()) == 2 and pool.pending == 8  # every third held out, the last two kept
    stream = ContinualStream(pool, shape, pad_token_id=0, seed=0, replay_ratio=0.5)
    first = stream.get(0)
    assert first.input_ids.shape == (64,) and first.anchors.shape == (4,)
    assert pool.pending == 4 and len(pool.replay) == 4  # 32 new tokens (four records), then replay fills
    stream.get(1)
    assert pool.pending == 0 and len(pool.replay) == 4  # the replay ring stays bounded
    assert stream.built(0, 2) and not stream.built(2, 3)
    assert stream.trained_seq == 12  # every record trained, the held-out 12 too


def test_trained_seq_is_a_prefix_of_the_records_trained():
    """What a checkpoint's cursor may move past: every record up to trained_seq is trained,
    though target threads pack micro-batches out of order, and a rewind (a target swap) gives
    records back behind others already trained."""
    shape = ShapeConfig(seq_len=64, num_anchors=4, block_size=4)
    pool = RecordPool(shape.seq_len, replay_capacity=100, heldout_capacity=1, heldout_every=0)
    for i in range(40):
        pool.add(Conversation(conv(i)["messages"], f"s:{i}"), doc(8))
    stream = ContinualStream(pool, shape, pad_token_id=0, seed=0, replay_ratio=0.5)

    def new(g: int) -> list[int]:  # a packed micro-batch's new records: four of 8 tokens each
        return [d.seq for d in stream._new[g]]

    stream.get(0), stream.get(1), stream.get(3)  # a second target thread ran ahead to 3
    stream.get(2)
    assert [new(1), new(3), new(2)] == [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    assert stream.built(0, 2) and stream.trained_seq == 8
    assert stream.built(2, 3) and stream.trained_seq == 8  # 13-16 trained, 9-12 not yet
    assert stream.built(3, 4) and stream.trained_seq == 16
    stream.get(4), stream.get(5), stream.get(6)
    assert stream.built(4, 5) and stream.trained_seq == 20
    stream.rewind(5)  # 21-28 back in the pool, and in the replay ring since they were first taken
    assert pool.pending == 20 and pool.oldest_waiting() == 21
    stream.get(5)
    assert new(5) == [21, 22, 23, 24]
    assert stream.built(5, 6) and stream.trained_seq == 24  # whatever micro-batch 5 replayed
    # packed out of order, then given back: in the pool in arrival order again
    stream.get(7), stream.get(6)
    assert [new(7), new(6)] == [[25, 26, 27, 28], [29, 30, 31, 32]]
    stream.rewind(6)
    assert [d.seq for d in list(pool.fresh)[:8]] == list(range(25, 33)) and pool.oldest_waiting() == 25
    with pytest.raises(StreamStopped):  # a thread of the closed pipeline, late for a packed index
        stream.get(5)
    assert pool.oldest_waiting() == 25 and stream.built(6, 7) is False


def test_stream_waits_for_new_records_and_stops_when_asked():
    shape = ShapeConfig(seq_len=32, num_anchors=2, block_size=4)
    pool = RecordPool(shape.seq_len, replay_capacity=8, heldout_capacity=1, heldout_every=0)
    stream = ContinualStream(pool, shape, pad_token_id=0, seed=0, replay_ratio=0.25)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(stream.get(0)))
    reader.start()
    time.sleep(0.3)
    assert not got  # nothing new: the reader waits
    pool.add(Conversation(conv(0)["messages"], "s:0"), doc(10))
    reader.join(5)
    assert got and int((got[0].doc_ids >= 0).sum()) >= 10
    stream.close()
    with pytest.raises(StreamStopped):
        stream.get(1)


def test_publisher_versions_latest_rotation_and_a_killed_publish(tmp_path):
    cfg = tiny_drafter_config()
    weights = {k: v.float() for k, v in random_drafter(cfg).state_dict().items()}
    target = {"name": None, "config_sha256": "abc", "dtype": None}
    publish_dir = tmp_path / "pub"
    pub = Publisher(str(publish_dir), [str(tmp_path)], keep_versions=2, target=target)
    for step in (10, 20, 30):
        entry = pub.publish(cfg, weights, step=step, tau=1.5, export_dtype="fp32")
    assert entry["version"] == 3
    assert sorted(p.name for p in publish_dir.iterdir()) == [LATEST, "v000002", "v000003", VERSIONS_FILE]
    assert (publish_dir / LATEST).resolve() == publish_dir / "v000003"
    listed = json.loads((publish_dir / VERSIONS_FILE).read_text())
    assert [v["version"] for v in listed] == [2, 3] and listed[-1]["step"] == 30
    assert json.loads((publish_dir / "v000003" / "config.json").read_text())["dflash_target"] == target
    pub.close()
    # a publish killed before its rename leaves a staging directory: swept, the previous version intact
    (publish_dir / ".staging-v000004").mkdir()
    again = Publisher(str(publish_dir), [str(tmp_path)], keep_versions=2, target=target)
    assert again.latest is not None and again.latest["version"] == 3
    assert not (publish_dir / ".staging-v000004").exists()
    assert again.publish(cfg, weights, step=40, tau=1.6, export_dtype="fp32")["version"] == 4
    again.close()
    with pytest.raises(PermissionError):
        Publisher(str(tmp_path.parent / "elsewhere"), [str(tmp_path)], 2, target)


def test_a_target_version_loads_in_place_and_other_shapes_are_refused(default_assets, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_core.continual.target_swap import SwapRefused, check_version, load_in_place, refresh_heads
    from dflash_core.target import TargetModel

    target = TargetModel(default_assets.target, [1, 2], "cpu", dtype=torch.float32)
    head = target.frozen_head().to("cpu", torch.float64)  # a drafter's own copy (another dtype)
    storage = target.model.model.norm.weight.data_ptr()

    def version(name, change=lambda k, v: v, config=None):
        out = tmp_path / name
        shutil.copytree(default_assets.target, out)
        weights = load_file(str(out / "model.safetensors"))
        save_file({k: change(k, v) for k, v in weights.items()}, str(out / "model.safetensors"))
        if config:
            cfg = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**cfg, **config}))
        return out

    v2 = version("v2", lambda k, v: v + 1.0 if v.is_floating_point() else v)
    load_in_place([target], check_version(target, v2, [str(tmp_path)]))
    refresh_heads(target, [head])
    assert target.model.model.norm.weight.data_ptr() == storage  # the same storage, new values
    assert torch.equal(target.model.model.norm.weight, load_file(str(v2 / "model.safetensors"))["model.norm.weight"])
    assert torch.allclose(head.lm_head_weight, target.model.get_output_embeddings().weight.double())
    with pytest.raises(SwapRefused, match=r"model\.norm\.weight has shape"):
        check_version(target, version("v3", lambda k, v: v[:-1] if k == "model.norm.weight" else v), [])
    with pytest.raises(SwapRefused, match="num_hidden_layers"):
        check_version(target, version("v4", config={"num_hidden_layers": 9}), [])
    with pytest.raises(SwapRefused, match="missing"):
        check_version(target, _without(version("v5"), "model.norm.weight"), [])


def _without(path, key):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights[key]
    save_file(weights, str(path / "model.safetensors"))
    return path


def test_the_feed_stops_reading_while_the_pool_is_full(tmp_path, default_assets):
    """max_pending: the feed is full at that many untrained records, and a poll that fills it
    ends before the next file, so a backlog of many files stays in them until it is trained."""
    from transformers import AutoTokenizer

    from dflash_core.continual.feed import Feed
    from dflash_core.data.tokenize import ChatTemplate

    pool = RecordPool(64, replay_capacity=4, heldout_capacity=1, heldout_every=0)
    feed = Feed(SourceWatcher([], None), pool, None, ChatTemplate(), 1.0, max_pending=2)
    pool.add(Conversation(conv(0)["messages"], "s:0"), doc(8))
    assert not feed.full
    pool.add(Conversation(conv(1)["messages"], "s:1"), doc(8))
    assert feed.full
    src = tmp_path / "backlog"
    src.mkdir()
    for f in range(5):
        (src / f"part-{f}.jsonl").write_text("".join(json.dumps(conv(10 * f + i)) + "\n" for i in range(10)))
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    pool = RecordPool(256, replay_capacity=4, heldout_capacity=1, heldout_every=0)
    watcher = SourceWatcher([(src, "backlog", [str(tmp_path)])], None)
    feed = Feed(watcher, pool, tokenizer, ChatTemplate(), 1.0, max_pending=3)
    assert feed.poll_once() == 10  # one file, then full
    assert feed.poll_once() == 0 and set(watcher.files) == {str(src / "part-0.jsonl")}


def _feed_on_one_large_file(src, records: int, default_assets):
    """A feed (not started) on `src`, which holds one JSONL file of `records` conversations."""
    from transformers import AutoTokenizer

    from dflash_core.continual.feed import Feed
    from dflash_core.data.tokenize import ChatTemplate

    src.mkdir()
    (src / "big.jsonl").write_text("".join(json.dumps(conv(i)) + "\n" for i in range(records)))
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    pool = RecordPool(64, replay_capacity=4, heldout_capacity=1, heldout_every=0)
    watcher = SourceWatcher([(src, "src", [str(src.parent)])], None)
    return Feed(watcher, pool, tokenizer, ChatTemplate(), 1.0), pool


def _wait_for_a_record(pool) -> None:
    deadline = time.monotonic() + 60
    while pool.added == 0 and time.monotonic() < deadline:
        time.sleep(0.001)


def test_the_jobs_thread_waits_for_a_record_not_for_a_whole_poll(tmp_path, default_assets):
    """While the ingest thread works through a large file, the job's thread gets the tokenizer
    after the record in hand (the ingest then waits, mid-file, until the job's thread is done), and
    what the job's thread reads of the cursor after every step and at checkpoints does not wait
    for the poll either."""
    src, records = tmp_path / "src", 4000
    feed, pool = _feed_on_one_large_file(src, records, default_assets)
    poller = threading.Thread(target=feed.poll_once)
    poller.start()
    try:
        _wait_for_a_record(pool)
        with feed.tokenizer_turns.first():
            during = pool.added
            answers: list = []
            # in a thread of its own, so that a reader waiting for the poll fails here, not hangs
            reader = threading.Thread(target=lambda: answers.append((feed.lines_read(src), feed.cursor_through(0))))
            reader.start()
            reader.join(timeout=10)
            time.sleep(0.2)
            assert 0 < during == pool.added < records  # stopped mid-file while the job's thread has its turn
    finally:
        poller.join(timeout=120)
    # a line counts as read once its record is in the pool (the one in hand may not count yet); the
    # checkpoint's cursor waits for the poll's end
    assert len(answers) == 1 and during - 1 <= answers[0][0]["big.jsonl"] <= during
    assert answers[0][1] == {"files": {}}
    assert pool.added == records and feed.lines_read(src) == {"big.jsonl": records}
    assert feed.cursor_through(records)["files"][str(src / "big.jsonl")]["line"] == records + 1


def test_a_feed_closed_mid_poll_stops_at_the_next_record(tmp_path, default_assets):
    """A job that ends while its ingest thread is in a large file does not wait for the file's
    end, and the cursor a checkpoint would save keeps none of the poll it left."""
    records = 4000
    feed, pool = _feed_on_one_large_file(tmp_path / "src", records, default_assets)
    feed.start()
    _wait_for_a_record(pool)
    with feed.tokenizer_turns.first():  # the ingest thread waits at its next record
        closing = threading.Thread(target=feed.close)
        closing.start()
        time.sleep(0.1)
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert 0 < pool.added < records and feed.error is None
    assert feed.cursor_through(pool.added) == {"files": {}}


def test_a_checkpoint_cursor_waits_for_the_answers_to_its_prompts(tmp_path, default_assets):
    """A prompt goes to the answerer, not the pool: the poll that read it is in a checkpoint's
    cursor only once its answer is trained, so a resume from that checkpoint reads the prompt again
    rather than losing it."""
    src = tmp_path / "src"
    src.mkdir()
    prompt = {"messages": [{"role": "user", "content": "q9"}]}
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (conv(0), prompt, conv(1))))
    feed, pool, answerer = _feed_with_answerer(src, default_assets)
    assert feed.poll_once() == 3 and pool.added == 2 and answerer.pending == 1
    assert feed.cursor_through(10**6) == {"files": {}}  # every record trained but the unanswered prompt
    conversations, skipped = answerer.answer(feed.tokenizer_turns.first)
    assert len(conversations) == 1 and not skipped
    assert feed.add_conversation(conversations[0]) and pool.added == 3
    feed.answered(answerer.answered_through)
    assert feed.cursor_through(2) == {"files": {}}  # the answer (arrival 3) not trained yet
    assert feed.cursor_through(3)["files"][str(src / "a.jsonl")]["line"] == 4
    with (src / "a.jsonl").open("a") as f:  # a later poll without prompts folds on its own records
        f.write(json.dumps(conv(2)) + "\n")
    assert feed.poll_once() == 1
    assert feed.cursor_through(4)["files"][str(src / "a.jsonl")]["line"] == 5


def test_a_prompt_answered_while_its_poll_still_reads_is_not_lost(tmp_path, default_assets):
    """The job's thread may answer a prompt before the poll that read it has ended (and a
    checkpoint may come in between): the poll's cursor still waits for that answer, and moves on
    once it is trained."""
    src = tmp_path / "src"
    src.mkdir()
    records = [{"messages": [{"role": "user", "content": "q9"}]}] + [conv(i) for i in range(4000)]
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    feed, pool, answerer = _feed_with_answerer(src, default_assets)
    poller = threading.Thread(target=feed.poll_once)
    try:
        # the prompt needs no turn at the tokenizer; the poll then waits at the next record
        with feed.tokenizer_turns.first():
            poller.start()
            deadline = time.monotonic() + 60
            while answerer.pending == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            conversations, _ = answerer.answer(feed.tokenizer_turns.first)
            assert feed.add_conversation(conversations[0]) and pool.added == 1
            feed.answered(answerer.answered_through)
            feed.cursor_through(10**6)  # a checkpoint while the poll that read the prompt goes on
    finally:
        poller.join(timeout=120)
    assert feed.cursor_through(10**6)["files"][str(src / "a.jsonl")]["line"] == len(records) + 1


def _feed_with_answerer(src, default_assets):
    """A feed on `src` with an answerer on the embedded target (greedy, 4 new tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_core.continual.answer import Answerer, AnswerSettings
    from dflash_core.continual.feed import Feed
    from dflash_core.data.tokenize import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    model = AutoModelForCausalLM.from_pretrained(str(default_assets.target), dtype=torch.float32).eval()
    target = types.SimpleNamespace(model=model)  # what the answerer uses of a loaded target
    answerer = Answerer(target, tokenizer, ChatTemplate(), AnswerSettings(max_new_tokens=4, slots=2), 64, ())
    pool = RecordPool(64, replay_capacity=4, heldout_capacity=1, heldout_every=0)
    watcher = SourceWatcher([(src, "src", [str(src.parent)])], None)
    return Feed(watcher, pool, tokenizer, ChatTemplate(), 1.0, answerer), pool, answerer


def test_the_spool_rolls_over_and_read_files_go_while_a_cursor_still_needs_none(tmp_path):
    from dflash_core.confine import ConfinedDir
    from dflash_core.continual.sources import drop_read_spool
    from service.jobs.records import RecordSpool

    spool_dir = tmp_path / "records"
    spool_dir.mkdir()
    spool = RecordSpool(str(spool_dir), [str(tmp_path)], file_bytes=100)
    for i in range(6):
        spool.append([json.dumps(conv(i))])  # each line ~90 bytes: a new file after each
    names = sorted(p.name for p in spool_dir.iterdir())
    assert names[0] == "ingested-000001.jsonl" and len(names) >= 3
    watcher = SourceWatcher([(spool_dir, "records", [str(tmp_path)])], None)
    assert len(list(watcher.poll())) == 6
    read = {key.rsplit("/", 1)[-1]: state["line"] - 1 for key, state in watcher.files.items()}
    assert spool.pending(read) == 0 and spool.pending({}) == 6
    behind = {"files": {str(spool_dir / names[0]): {"offset": 0, "line": 1}}}
    with ConfinedDir(spool_dir, [str(tmp_path)]) as directory:
        assert drop_read_spool(directory, [watcher.cursor(), behind]) == []  # an older cursor still needs it
        dropped = drop_read_spool(directory, [watcher.cursor()])
    assert dropped == names[:-1] and sorted(p.name for p in spool_dir.iterdir()) == names[-1:]
    assert RecordSpool(str(spool_dir), [str(tmp_path)]).pending(read) == 0  # counted again after a restart


def test_a_checkpoint_cursor_covers_only_trained_records(tmp_path, default_assets):
    """cursor_through(seq): the cursor of the newest poll all of whose records arrived by `seq`
    (trained), built from what each poll changed; a later poll's files are not in it, and a
    watcher resumed from it reads again exactly what came after."""
    from transformers import AutoTokenizer

    from dflash_core.continual.feed import Feed
    from dflash_core.data.tokenize import ChatTemplate

    src = tmp_path / "src"
    src.mkdir()
    tokenizer = AutoTokenizer.from_pretrained(str(default_assets.target))
    pool = RecordPool(64, replay_capacity=4, heldout_capacity=1, heldout_every=0)
    feed = Feed(SourceWatcher([(src, "src", [str(tmp_path)])], None), pool, tokenizer, ChatTemplate(), 1.0)
    (src / "a.jsonl").write_text(json.dumps(conv(0)) + "\n" + json.dumps(conv(1)) + "\n")
    assert feed.poll_once() == 2
    assert feed.poll_once() == 0  # nothing new: no change recorded
    (src / "b.jsonl").write_text(json.dumps(conv(2)) + "\n")
    with (src / "a.jsonl").open("a") as f:
        f.write(json.dumps(conv(3)) + "\n")
    assert feed.poll_once() == 2
    first = feed.cursor_through(2)  # the first poll's two records trained, not the second's
    assert set(first["files"]) == {str(src / "a.jsonl")} and first["files"][str(src / "a.jsonl")]["line"] == 3
    saved = json.loads(json.dumps(first))  # as a checkpoint stores it
    resumed = SourceWatcher([(src, "src", [str(tmp_path)])], saved)
    assert values(resumed.poll()) == [conv(3), conv(2)]  # a.jsonl read on, then b.jsonl
    assert feed.cursor_through(1) == first  # an older seq than the last checkpoint's: the same cursor
    both = feed.cursor_through(4)
    assert both["files"][str(src / "a.jsonl")]["line"] == 4 and str(src / "b.jsonl") in both["files"]
    assert values(SourceWatcher([(src, "src", [str(tmp_path)])], both).poll()) == []
