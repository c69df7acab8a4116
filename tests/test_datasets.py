"""Datasets as users keep them: every layout reads the same conversations, tokenization is cached
on disk and reused, workers give the same tokens as one process, bad input names its place, and
the loss mask stays assistant-only for Qwen3-style (with and without thinking) and Llama-3.1-style
templates, checked against the tokenizer's own assistant mask."""

from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash_core.data import chunks, prepare, sources
from dflash_core.data.conversations import Conversation, DatasetError, read_conversations
from dflash_core.data.inspect import check_dataset
from dflash_core.data.prepare import Tokenization, prepare_corpus, save_tokenizer
from dflash_core.data.tokenize import ChatTemplate, encode_conversation

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
SEQ_LEN = 512


@pytest.fixture(scope="module")
def records(default_assets) -> list[dict]:
    lines = default_assets.train.read_text().splitlines()[:60]
    return [json.loads(line) for line in lines]


def as_sharegpt(record: dict) -> dict:
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": role[m["role"]], "value": m["content"]} for m in record["messages"]]}


def write_layouts(root: Path, records: list[dict]) -> dict[str, Path]:
    """The same conversations in every layout the daemon reads."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    out = {}
    out["jsonl"] = root / "all.jsonl"
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    out["jsonl_gz"] = root / "all.jsonl.gz"
    out["jsonl_gz"].write_bytes(gzip.compress(out["jsonl"].read_bytes()))
    out["json_array"] = root / "all.json"
    out["json_array"].write_text(json.dumps([as_sharegpt(r) for r in records], indent=2))
    out["parquet"] = root / "all.parquet"
    pq.write_table(pa.Table.from_pylist(records), out["parquet"])
    shards = root / "shards"
    shards.mkdir()
    third = len(records) // 3
    (shards / "part-000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:third]))
    (shards / "part-001.json").write_text(json.dumps([as_sharegpt(r) for r in records[third : 2 * third]]))
    pq.write_table(pa.Table.from_pylist(records[2 * third :]), shards / "part-002.parquet")
    (shards / "README.txt").write_text("not a shard: ignored\n")
    out["shards"] = shards
    out["save_to_disk"] = root / "hf"
    datasets.Dataset.from_list(records).save_to_disk(str(out["save_to_disk"]))
    out["dataset_dict"] = root / "hf_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(out["dataset_dict"]))
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, records) -> dict[str, Path]:
    return write_layouts(tmp_path_factory.mktemp("layouts"), records)


@pytest.fixture(scope="module")
def tokenizer(default_assets):
    return AutoTokenizer.from_pretrained(str(default_assets.target))


@pytest.fixture()
def tokenization(tokenizer, tmp_path) -> Tokenization:
    directory, digest = save_tokenizer(tokenizer, tmp_path / "cache")
    return Tokenization(str(directory), digest, ChatTemplate(), SEQ_LEN)


def test_every_layout_reads_the_same_conversations(layouts, records):
    want = [[m["content"] for m in r["messages"]] for r in records]
    for name, path in layouts.items():
        got = [[m["content"] for m in c.messages] for c in read_conversations(path)]
        assert got == want, name
        assert check_dataset(path) >= 1


def test_corpus_equals_in_memory_tokenization_and_is_cached(layouts, records, tokenizer, tokenization, tmp_path):
    expected = [encode_conversation(tokenizer, Conversation(r["messages"], "x")) for r in records]
    cache = tmp_path / "cache"
    for name in ("jsonl", "jsonl_gz", "shards", "save_to_disk"):
        seen = []
        corpus = prepare_corpus([str(layouts[name])], tokenization, cache, progress=seen.append)
        assert len(corpus) == len(records), name
        for i, doc in enumerate(expected):
            ids, mask = corpus.document(i)
            assert np.array_equal(ids, doc.input_ids[:SEQ_LEN]) and np.array_equal(mask, doc.loss_mask[:SEQ_LEN])
        assert seen[-1].fraction == 1.0 and seen[-1].files_cached == 0 and seen[-1].documents == len(records)
        again = []
        prepare_corpus([str(layouts[name])], tokenization, cache, progress=again.append)
        assert again[-1].files_cached == again[-1].files_total  # nothing tokenized the second time


@pytest.mark.slow  # tokenizes the dataset twice, once in a worker pool
def test_workers_give_the_same_tokens_as_one_process(layouts, tokenization, tmp_path, monkeypatch):
    one = prepare_corpus([str(layouts["shards"])], tokenization, tmp_path / "one", workers=1)
    monkeypatch.setattr(prepare, "IN_PROCESS_BYTES", 0)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 2048)  # several byte ranges per JSONL file
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 7)
    monkeypatch.setattr(chunks, "ARRAY_BATCH", 5)
    many = prepare_corpus([str(layouts["shards"])], tokenization, tmp_path / "many", workers=2)
    assert len(one) == len(many)
    for i in range(len(one)):
        for a, b in zip(one.document(i), many.document(i), strict=True):
            assert np.array_equal(a, b)
    assert np.array_equal(one.shards[0].positions, many.shards[0].positions)  # line numbers survive chunking


def test_large_array_elements_are_sent_to_workers_in_batches_bounded_by_their_text(tmp_path):
    """A JSON array's and a gzip JSONL file's records are parsed by the preparing process and sent
    to the workers in batches: a batch ends at CHUNK_BYTES of message text as well as at
    ARRAY_BATCH records, so elements of a megabyte do not put a thousand megabytes in flight."""
    from dflash_core.data.sources import dataset_files

    big = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * (1 << 19)}]}
    # what else a record carries is not sent to the workers (nor counted)
    small = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "image": "x" * 500}
    records = [big] * 12 + [small] * 3000
    (tmp_path / "array.json").write_text(json.dumps(records))
    with gzip.open(tmp_path / "lines.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for name in ("array.json", "lines.jsonl.gz"):
        (src,) = dataset_files(tmp_path / name)
        batches = [task[1] for task, _ in chunks.chunk_tasks(src)]
        assert [len(b) for b in batches] == [4, 4, 4, 1024, 1024, 952], name
        assert [position for b in batches for position, _ in b] == list(range(1, len(records) + 1))
        assert all(list(record) == ["messages"] for b in batches for _, record in b)


def test_a_changed_file_is_tokenized_again(records, tokenization, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:10]))
    cache = tmp_path / "cache"
    assert len(prepare_corpus([str(path)], tokenization, cache)) == 10
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:12]))
    seen = []
    assert len(prepare_corpus([str(path)], tokenization, cache, progress=seen.append)) == 12
    assert seen[-1].files_cached == 0


def test_template_options_key_the_cache(records, tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    directory, digest = save_tokenizer(tokenizer, tmp_path / "cache")
    template = (TEMPLATES / "qwen3_style.jinja").read_text()
    keys = {
        Tokenization(str(directory), digest, ChatTemplate.of(template, kw), SEQ_LEN).key(prepare.dataset_files(path)[0])
        for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True})
    }
    assert len(keys) == 3


@pytest.mark.parametrize(
    "write, where, words",
    [
        (lambda p: p.write_text('{"messages": []}\n'), ":1", "empty"),
        (lambda p: p.write_bytes(b'{"messages": [{"role": "user", "content": "\xff"}]}\n'), ":1", "UTF-8"),
        (lambda p: p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n'), ":1", "no assistant"),
        (lambda p: p.write_text('{"text": "hi"}\n'), ":1", "no 'messages'"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, write, where, words):
    path = tmp_path / "bad.jsonl"
    write(path)
    with pytest.raises(DatasetError) as err:
        check_dataset(path)
    assert f"bad.jsonl{where}" in str(err.value) and words in str(err.value)


def test_structural_problems_are_refused(tmp_path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match=r"no \.jsonl, \.jsonl\.gz, \.json or \.parquet"):
        check_dataset(empty)
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), tmp_path / "wrong.parquet")
    with pytest.raises(DatasetError, match=r"wrong.parquet: no 'messages' or 'conversations' column \(columns: text\)"):
        check_dataset(tmp_path / "wrong.parquet")
    broken = tmp_path / "broken.json"
    broken.write_text(
        '[\n  {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},\n  {"mess'
    )
    with pytest.raises(DatasetError, match=r"broken.json:3: invalid JSON"):
        list(read_conversations(broken))
    assert len(list(read_conversations(broken, skip_bad_lines=True))) == 1


def test_bom_and_bad_lines_deep_in_a_shard(tmp_path, records, tokenization):
    path = tmp_path / "bom.jsonl"
    lines = [json.dumps(r) for r in records[:30]]
    lines[25] = "{broken"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    assert check_dataset(path) == 1  # the first records, BOM included, read fine
    corpus = prepare_corpus([str(path)], tokenization, tmp_path / "cache")
    assert len(corpus) == 29 and corpus.bad_records == 1
    assert [str(e) for e in corpus.errors()] == [
        f"{path}:26: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    ]


def conversations_for_templates() -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": "count to three"}, {"role": "assistant", "content": "one two three"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "and again"},
            {"role": "assistant", "content": "hello again\nbye"},
        ],
    ]


@pytest.mark.parametrize(
    "name, kwargs, reasoning",
    [
        ("qwen3_style", {"enable_thinking": False}, False),
        ("qwen3_style", {"enable_thinking": True}, True),
        ("llama31_style", {}, False),
    ],
)
def test_loss_mask_equals_the_tokenizers_assistant_mask(default_assets, name, kwargs, reasoning):
    tok = AutoTokenizer.from_pretrained(str(default_assets.target))
    markers = [
        "<|im_start|>",
        "<|im_end|>",
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok.add_special_tokens({"additional_special_tokens": [*markers, "<think>", "</think>"]})
    template = ChatTemplate.of((TEMPLATES / f"{name}.jinja").read_text(), kwargs)
    convs = conversations_for_templates()
    if reasoning:
        convs.append(
            [
                {"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": "<think>\n2 plus 3 is 5\n</think>\n\nfive"},
            ]
        )
    for messages in convs:
        doc = encode_conversation(tok, Conversation(messages, "x:1"), template)
        ref = tok.apply_chat_template(
            messages,
            chat_template=template.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
        assert list(doc.input_ids) == list(ref["input_ids"])
        assert np.array_equal(doc.loss_mask, np.asarray(ref["assistant_masks"], dtype=bool)), messages
        assert doc.loss_mask.any() and not doc.loss_mask.all()
    # a conversation of 1,200 turns cut to its first 50 tokens: the same tokens and mask, and only
    # the turns the kept tokens reach are rendered for their spans (each such render covers the
    # conversation up to the turn, so rendering every turn grows with the square of the turns)
    turns = [*convs[-1][:1], *(convs[-1][-2:] + conversations_for_templates()[1][-4:]) * 200]
    ref = tok.apply_chat_template(turns, chat_template=template.template, return_dict=True, **kwargs)
    mask = tok.apply_chat_template(
        turns, chat_template=template.template, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )["assistant_masks"]
    counting = _CountingRenders(tok)
    doc = encode_conversation(counting, Conversation(turns, "x:1"), template, max_tokens=50)
    assert doc.cut and list(doc.input_ids) == list(ref["input_ids"][:50])
    assert np.array_equal(doc.loss_mask, np.asarray(mask[:50], dtype=bool)) and doc.loss_mask.any()
    assert 3 <= counting.renders <= 30, counting.renders


class _CountingRenders:
    """A tokenizer that counts its chat template's renders."""

    def __init__(self, tok):
        self.tok, self.renders = tok, 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self.tok.apply_chat_template(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_json_array_element_up_to_the_record_bound_is_read_and_one_past_it_is_named(tmp_path, monkeypatch):
    """An element is read through however many blocks it spans (the buffer grows by what the
    element holds so far, so a large one is parsed a few times, not once per block), up to the
    record bound in UTF-8 bytes; one past it is the bad record at its line and the elements around
    it are read, whatever came before it in the buffer; one whose end lies past twice the bound
    ends the file. (The bound and the block made small here: 64 KiB and 4 KiB.)"""
    from dflash_core.data import sources

    bound = 64 << 10
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", bound)
    monkeypatch.setattr(sources, "_READ_CHUNK", 4 << 10)

    def element(size: int, char: str = "a") -> str:
        head = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "'
        return head + char * (size - len(head) - 4) + '"}]}'

    def read(*elements: str) -> list:
        path = tmp_path / "big.json"
        path.write_text("[" + ",\n".join(elements) + "]")
        return [
            (p, isinstance(r, DatasetError) and str(r))
            for p, r in sources.iter_records(sources.file_source(path, "big.json"))
        ]

    small, too_large = element(100), "big.json:2: element larger than"
    assert read(small, element(bound - 10), small) == [(1, False), (2, False), (3, False)]
    for before in (small, element(3000)):  # what the buffer holds past the first element differs
        got = read(before, element(bound + bound // 2), small)
        assert [p for p, _ in got] == [1, 2, 3] and got[1][1].startswith(too_large) and not got[2][1], got
    got = read(small, element(bound // 3 + 1000, "€"), small)  # fewer characters than the bound, more bytes
    assert [p for p, _ in got] == [1, 2, 3] and got[1][1].startswith(too_large), got
    got = read(small, element(2 * bound + (16 << 10)), small)  # its end is not looked for
    assert [p for p, _ in got] == [1, 2] and got[1][1].startswith(too_large), got
    got = read(small, element(bound, "\U0001f600"), small)  # as many characters, four times the bytes
    assert [p for p, _ in got] == [1, 2] and got[1][1].startswith(too_large), got
    # a syntax error is named as such at once, however much of the file follows it
    got = read(small, '{"messages": [1 2]}', *[element(bound // 2)] * 8)
    assert got == [(1, False), (2, "big.json:2: invalid JSON: Expecting ',' delimiter")], got
    # a number that a block's end cuts is read whole, and the elements after it are read
    path = tmp_path / "cut.json"
    path.write_text("[" + " " * ((4 << 10) - 3) + "12345, " + small + "]")
    got = [r for _, r in sources.iter_records(sources.file_source(path, "cut.json"))]
    assert got[0] == 12345 and isinstance(got[1], dict) and len(got) == 2, got


def test_json_array_elements_on_one_line_are_told_apart(records, tokenization, tmp_path):
    """json.dump writes an array on one line: elements are numbered by their place in the array,
    so held-out prompts read back are the right ones."""
    path = tmp_path / "one-line.json"
    path.write_text(json.dumps(records[:6]))
    corpus = prepare_corpus([str(path)], tokenization, tmp_path / "cache")
    assert list(corpus.shards[0].positions) == [1, 2, 3, 4, 5, 6]
    got = corpus.conversations([4, 1])
    assert [c.messages for c in got] == [records[4]["messages"], records[1]["messages"]]
    assert got[0].source.endswith("one-line.json element 5")


def test_a_file_listed_twice_is_read_once_and_lone_carriage_returns_keep_line_numbers(
    records, tokenization, tmp_path, monkeypatch
):
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = [json.dumps(r) for r in records[:8]]
    lines[2] = lines[2].replace(", ", ",\r ", 1)  # a bare CR is JSON whitespace inside the line
    lines[5] = "{broken"
    (shards / "a.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(prepare, "IN_PROCESS_BYTES", 0)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 600)  # byte ranges through the chunked reader
    corpus = prepare_corpus([str(shards), str(shards / "a.jsonl")], tokenization, tmp_path / "cache", workers=1)
    assert len(corpus.shards) == 1 and len(corpus) == 7
    assert [e.line for e in corpus.errors()] == [6]


def test_errors_name_the_entry_as_given_not_where_it_resolves(records, tokenization, tmp_path):
    """A directory entry reached through a symlinked root, holding a shard that is itself a
    symlink: errors name the entry as given plus the shard's name in it, never a resolved path;
    the cache holds no names, so the same files read under another name are named by it."""
    from dflash_core.confine import OutsideRoots

    roots = tmp_path / "roots"
    (roots / "real" / "shards").mkdir(parents=True)
    (roots / "elsewhere").mkdir()
    (roots / "link").symlink_to(roots / "real")
    lines = [json.dumps(r) for r in records[:30]]
    (roots / "real" / "shards" / "a.jsonl").write_text("\n".join([*lines[:25], "{broken", *lines[26:]]) + "\n")
    (roots / "elsewhere" / "target.jsonl").write_text("\n".join([lines[0], "{broken", *lines[2:5]]) + "\n")
    (roots / "real" / "shards" / "b.jsonl").symlink_to(roots / "elsewhere" / "target.jsonl")
    entry = str(roots / "link" / "shards")
    cache = tmp_path / "cache"
    corpus = prepare_corpus([entry], tokenization, cache, roots=[str(roots)], names={entry: "given/shards"})
    assert [e.where for e in corpus.errors()] == ["given/shards/a.jsonl:26", "given/shards/b.jsonl:2"]
    again = prepare_corpus([entry], tokenization, cache, roots=[str(roots)], names={entry: "other/"})
    assert [e.where for e in again.errors()] == ["other/a.jsonl:26", "other/b.jsonl:2"]
    with pytest.raises(DatasetError) as err:
        check_dataset(entry, name="given/shards")
    assert str(err.value).startswith("given/shards/b.jsonl:2: invalid JSON")
    with pytest.raises(DatasetError) as err:
        list(read_conversations(entry, name="given/shards"))
    assert str(err.value).startswith("given/shards/a.jsonl:26: invalid JSON")
    # a shard that now leads out of the roots is refused under its given name
    (tmp_path / "outside.jsonl").write_text(lines[0] + "\n")
    (roots / "real" / "shards" / "c.jsonl").symlink_to(tmp_path / "outside.jsonl")
    with pytest.raises(OutsideRoots) as refused:
        prepare_corpus([entry], tokenization, cache, roots=[str(roots)], names={entry: "given/shards"})
    assert "'given/shards/c.jsonl'" in str(refused.value) and str(tmp_path) not in str(refused.value)


def test_a_corrupt_gzip_dataset_names_file_and_line(records, tmp_path):
    """A truncated .jsonl.gz reads up to where the stream breaks, then names the file and the
    line; a .jsonl.gz that is not gzip at all is named too."""
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match=r"cut\.jsonl\.gz:\d+: not a readable gzip stream"):
        list(read_conversations(tmp_path / "cut.jsonl.gz"))
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(DatasetError, match=r"plain\.jsonl\.gz:1: not a readable gzip stream"):
        check_dataset(tmp_path / "plain.jsonl.gz")


def _damaged_parquet(records: list[dict], path: Path, group_rows: int, damaged: int) -> None:
    """`records` as parquet in row groups of `group_rows`, the pages of row group `damaged` overwritten."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=group_rows)
    meta = pq.ParquetFile(path).metadata

    def first_page(group: int) -> int:
        chunks = [meta.row_group(group).column(c) for c in range(meta.num_columns)]
        return min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks)

    start, end = first_page(damaged), first_page(damaged + 1)
    data = bytearray(path.read_bytes())
    data[start:end] = bytes(b ^ 0x5A for b in data[start:end])
    path.write_bytes(bytes(data))


def test_a_damaged_parquet_row_group_is_named_and_the_others_are_read(records, tokenization, tmp_path, monkeypatch):
    """Row groups are apart: one that cannot be read is named with its rows, and the groups
    around it are read, whether the file is read in one pass or as row ranges (the tasks of the
    tokenization workers, several per row group here)."""
    path = tmp_path / "three-groups.parquet"
    _damaged_parquet(records, path, 20, damaged=1)
    with pytest.raises(DatasetError, match=r"three-groups\.parquet row 21: row group 1 \(rows 21-40\) cannot be read"):
        list(read_conversations(path))
    monkeypatch.setattr(prepare, "IN_PROCESS_BYTES", 1 << 40)  # the row ranges read here, in order
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 7)
    corpus = prepare_corpus([str(path)], tokenization, tmp_path / "cache")
    assert len(corpus) == len(records) - 20 and corpus.bad_records == 4  # one per task in the group
    errors = [str(e) for e in corpus.errors()]
    assert errors[0].startswith(f"{path} row 21: row group 1 (rows 21-40) cannot be read (")
    assert list(corpus.shards[0].positions) == [*range(1, 21), *range(41, len(records) + 1)]


def test_tasks_in_one_huge_row_group_hold_a_batch_and_break_where_one_pass_breaks(tmp_path, monkeypatch):
    """A parquet file written as one row group (pandas' and pyarrow's default up to a million
    rows): the tasks a worker gets (every third here) stream the group, so Arrow holds about a
    batch of it, never the decoded group; they read the rows the one-pass reader reads. With a
    page in the middle of the group damaged, the tasks read the rows before it and break at the
    row where one pass breaks; each later task is one error at its first row. A task holding the
    whole damaged group reads what one pass reads of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_core.data.sources import file_source, iter_records

    monkeypatch.setattr(chunks, "CHUNK_ROWS", 1000)
    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"{i} " * 120}]}
        for i in range(40_000)
    ]
    table = pa.Table.from_pylist(records)
    decoded = table.nbytes
    path = tmp_path / "one-group.parquet"
    pq.write_table(table, path, row_group_size=len(records), data_page_size=1 << 16, compression="snappy")
    del table
    src = file_source(path, "one-group.parquet")
    tasks = [task for task, _ in chunks.chunk_tasks(src)]
    assert len(tasks) == 40 and pq.ParquetFile(path).metadata.num_row_groups == 1
    base = pa.total_allocated_bytes()  # what else this process holds in Arrow's pool
    peak, got = 0, []
    for task in tasks[::3]:
        for position, record in chunks._chunk_records(src, task):
            peak = max(peak, pa.total_allocated_bytes() - base)
            got.append((position, record))
    chunks.release_kept()
    assert got == [(p, r) for p, r in iter_records(src) if (p - 1) // 1000 % 3 == 0]
    assert peak < decoded / 4, (peak, decoded)  # the group whole before: peak = decoded

    # a page in the middle of the group overwritten
    data = bytearray(path.read_bytes())
    column = pq.ParquetFile(path).metadata.row_group(0).column(1)  # the assistant turns' content
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    one_pass = list(iter_records(src))
    broke = next(p for p, r in one_pass if isinstance(r, DatasetError))
    assert 1000 < broke < 39_000 and str(one_pass[-1][1]).startswith(f"one-group.parquet row {broke}: row group 0")
    read = [item for task in tasks for item in chunks._chunk_records(src, task)]
    assert [p for p, r in read if not isinstance(r, DatasetError)] == list(range(1, broke))
    errors = [(p, str(r)) for p, r in read if isinstance(r, DatasetError)]
    assert [p for p, _ in errors] == [broke, *range((broke - 1) // 1000 * 1000 + 1001, 40_000, 1000)]
    assert errors[0][1] == str(one_pass[-1][1]) and "from row" in errors[-1][1]
    # a task that holds the whole group reads it whole, and where that fails, the rows before the page
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 50_000)
    (task,) = [task for task, _ in chunks.chunk_tasks(src)]

    def shown(items):
        return [(p, str(r) if isinstance(r, DatasetError) else r) for p, r in items]

    assert shown(chunks._chunk_records(src, task)) == shown(one_pass)


def test_text_that_is_not_utf8_in_a_parquet_page_is_a_bad_batch_and_the_rest_is_read(tmp_path, monkeypatch):
    """An uncompressed page whose bytes were changed reads, but a string in it is not UTF-8: the
    1,024-row batch holding it is one bad record (per task that holds some of it), and the rows
    after it are read, by one pass, by tasks that cut the group and by a task that holds it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i:05d}"}]}
        for i in range(4000)
    ]
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, compression="NONE", use_dictionary=False)
    data = path.read_bytes()
    at = data.index(b"answer 01500")
    path.write_bytes(data[:at] + b"\xff" + data[at + 1 :])
    src = sources.file_source(path, path.name)

    def shown(items):
        return [(p, str(r) if isinstance(r, DatasetError) else r) for p, r in items]

    one_pass = shown(sources.iter_records(src))
    bad = [(p, r) for p, r in one_pass if isinstance(r, str)]
    assert bad == [(1025, bad[0][1])] and bad[0][1].startswith("plain.parquet row 1025: rows 1025-2048 of row group 0")
    assert [p for p, _ in one_pass] == [*range(1, 1026), *range(2049, 4001)]
    for rows, errors in ((1000, [1025, 2001]), (8192, [1025])):
        monkeypatch.setattr(chunks, "CHUNK_ROWS", rows)
        tasks = shown(item for task, _ in chunks.chunk_tasks(src) for item in chunks._chunk_records(src, task))
        assert [p for p, r in tasks if isinstance(r, str)] == errors
        assert [(p, r) for p, r in tasks if not isinstance(r, str)] == [
            (p, r) for p, r in one_pass if not isinstance(r, str)
        ]


def test_a_worker_closes_a_kept_row_group_stream_when_it_moves_to_another_file(
    records, tokenization, tmp_path, monkeypatch
):
    """A process keeps the stream of a row group that a task cut for its next task in the group;
    a task of another file closes it (another worker may read the rest of the group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(chunks, "CHUNK_ROWS", 10)
    one_group = tmp_path / "one-group.parquet"
    pq.write_table(pa.Table.from_pylist(records[:40]), one_group, row_group_size=40)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))

    def open_here(path: Path) -> bool:
        return any(os.path.realpath(fd) == str(path) for fd in glob.glob("/proc/self/fd/*"))

    src = sources.file_source(one_group, one_group.name)
    first, *_ = [task for task, _ in chunks.chunk_tasks(src)]
    assert chunks.tokenize_chunk(src, first, tokenization, 0).records == 10
    assert open_here(one_group)  # kept for this process's next task in the group
    jsonl = sources.file_source(other, other.name)
    (task,) = [task for task, _ in chunks.chunk_tasks(jsonl)]
    assert chunks.tokenize_chunk(jsonl, task, tokenization, 0).records == 5
    assert not open_here(one_group)


OPEN_FILES_SCRIPT = """
import json, resource, sys
from pathlib import Path
from dflash_core.data import prepare
from dflash_core.data.conversations import DatasetError
from dflash_core.data.tokenize import ChatTemplate
from dflash_core.data.tokenization import Tokenization
args = json.loads(sys.argv[1])
prepare.IN_MEMORY_BYTES = 0  # every array mapped: an open file each
open_now = len(list(Path("/proc/self/fd").iterdir()))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
tok = Tokenization(args["dir"], args["hash"], ChatTemplate(), args["seq_len"])
try:
    prepare.prepare_corpus([args["data"]], tok, Path(args["cache"]), workers=1)
except DatasetError as e:
    print("REFUSED", e)
"""


def test_a_corpus_of_many_small_files_holds_no_file_open_and_running_out_quarantines_nothing(
    records, tokenization, tmp_path, monkeypatch
):
    """Small arrays are read into memory, so an open corpus of many small files holds no file
    descriptor or memory map per file. Where a process does run out of open files (arrays
    mapped, a low limit), the entries are not taken for corrupt: the error says what ran out and
    every entry is still there for the next open."""
    import subprocess
    import sys

    data = tmp_path / "shards"
    data.mkdir()
    for i in range(60):
        (data / f"part-{i:03d}.jsonl").write_text(json.dumps(records[i % len(records)]) + "\n")
    cache = tmp_path / "cache"
    prepare_corpus([str(data)], tokenization, cache, workers=1)
    before = len(list(Path("/proc/self/fd").iterdir()))
    corpus = prepare_corpus([str(data)], tokenization, cache, workers=1)
    assert len(corpus) == 60 and len(list(Path("/proc/self/fd").iterdir())) <= before + 4
    del corpus
    monkeypatch.setattr(prepare, "IN_MEMORY_BYTES", 0)  # past the corpus's budget, arrays are mapped
    mapped = prepare_corpus([str(data)], tokenization, cache, workers=1)
    assert len(list(Path("/proc/self/fd").iterdir())) >= before + 100
    del mapped
    entries = sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != "quarantine")
    args = {"dir": tokenization.tokenizer_dir, "hash": tokenization.tokenizer_hash, "seq_len": SEQ_LEN}
    args.update(data=str(data), cache=str(cache))
    run = subprocess.run(
        [sys.executable, "-c", OPEN_FILES_SCRIPT, json.dumps(args)], capture_output=True, text=True, timeout=120
    )
    assert "REFUSED" in run.stdout and "ran out of" in run.stdout and "open-file limit" in run.stdout, run
    assert sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != "quarantine") == entries
    assert not any((cache / "quarantine").glob("*"))
    seen = []
    prepare_corpus([str(data)], tokenization, cache, workers=1, progress=seen.append)
    assert seen[-1].files_cached == 60


def test_trainable_documents_over_blocks_equal_their_definition(records, tokenization, tmp_path, monkeypatch):
    """Corpus.trainable, computed over blocks of documents (here a few dozen tokens each, so that
    blocks end inside and between documents), is each document's own test: two tokens or more,
    and a loss-masked token after the first."""
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in records[:40]]
    lines += [
        json.dumps({"messages": [{"role": "user", "content": "only a question"}, {"role": "assistant", "content": ""}]})
    ]
    path.write_text("\n".join(lines) + "\n")
    corpus = prepare_corpus([str(path)], tokenization, tmp_path / "cache")
    want = np.array([len(ids) >= 2 and bool(mask[1:].any()) for ids, mask in map(corpus.document, range(len(corpus)))])
    assert want.any()
    for block in (1 << 22, 37, 1):
        monkeypatch.setattr(prepare, "TRAINABLE_BLOCK_TOKENS", block)
        assert np.array_equal(corpus.trainable(), want), block


def test_compressed_files_count_the_text_they_hold(records, tmp_path):
    """Whether tokenization starts workers goes by what a file holds decompressed: a small
    parquet or .jsonl.gz file of repetitive text holds several times its size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_core.data.sources import file_size, file_source, text_bytes

    text = "".join(json.dumps(records[i % 5]) + "\n" for i in range(3000))
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    pq.write_table(pa.Table.from_pylist([records[i % 5] for i in range(3000)]), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text(text)
    for name in ("t.jsonl.gz", "t.parquet"):
        src = file_source(tmp_path / name, name)
        assert text_bytes(src) > 3 * file_size(src), name
    plain = file_source(tmp_path / "t.jsonl", "t.jsonl")
    assert text_bytes(plain) == file_size(plain) == len(text.encode())
    assert text_bytes(file_source(tmp_path / "t.jsonl.gz", "t.jsonl.gz")) == len(text.encode())
