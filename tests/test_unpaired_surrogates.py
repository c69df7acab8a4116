"""A JSON string escape of an unpaired UTF-16 surrogate (`\\ud800`) parses in Python but is no
text: a tokenizer refuses it with a bare TypeError and a UTF-8 writer with a UnicodeEncodeError,
far from the line it came from. Every reader takes such a record as a bad record at its place
(skipped with skip_bad_lines, reported by a continual job), and the ingest route names its line;
a pair of escapes (one character, an emoji) is text and passes. Also: a continual source file
that is not records at all (a foreign or corrupt parquet) is skipped and reported, not the job's end."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.continual.sources import SourceWatcher
from dflash_core.data.bounded import LONE_SURROGATE
from dflash_core.data.conversations import DatasetError, read_conversations
from dflash_core.data.inspect import check_dataset
from dflash_core.data.prompts import read_prompts
from service.jobs.records import parse_records
from service.jobs.schemas import SpecError

GOOD = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
LONE = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x\\ud800y"}]}'
LONE_KEY = '{"messages": [{"role": "user", "content": "q", "\\udc00": 1}, {"role": "assistant", "content": "a"}]}'
PAIRED = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\ud83d\\ude00"}]}'
ESCAPED = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\\\ud800"}]}'


@pytest.mark.parametrize("bad", [LONE, LONE_KEY])
def test_a_json_line_with_one_is_a_bad_line(tmp_path, bad):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD, bad, PAIRED, ESCAPED]) + "\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: a string holds an unpaired UTF-16 surrogate"):
        check_dataset(path)
    read = list(read_conversations(path, skip_bad_lines=True))
    assert [c.messages[1]["content"] for c in read] == ["a", "\U0001f600", "\\ud800"]
    for c in read:  # what passes is text
        json.dumps(c.messages, ensure_ascii=False).encode("utf-8")


def test_a_json_array_element_with_one_is_a_bad_element(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[" + ",\n".join([GOOD, LONE, PAIRED]) + "]")
    with pytest.raises(DatasetError, match=LONE_SURROGATE.split(" (")[0]):
        check_dataset(path)
    assert len(list(read_conversations(path, skip_bad_lines=True))) == 2


def test_a_regeneration_prompt_with_one_is_named_at_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "lone \\ud800 x"}\n{"prompt": "fine"}\n')
    with pytest.raises(DatasetError, match=r"p\.jsonl:1: a string holds"):
        next(read_prompts(path))
    assert [p.messages for p in read_prompts(path, skip_bad_lines=True)] == [[{"role": "user", "content": "fine"}]]


def test_the_ingest_route_names_the_line():
    with pytest.raises(SpecError) as e:
        parse_records((GOOD + "\n" + LONE + "\n" + PAIRED + "\n").encode(), prompts_allowed=False)
    assert [(x["field"], x["message"]) for x in e.value.errors] == [("line 2", LONE_SURROGATE)]
    # UTF-16 bytes: json.loads alone decodes them, and the escape's bytes are not the UTF-8 ones
    with pytest.raises(SpecError) as e:
        parse_records(LONE.encode("utf-16-le"), prompts_allowed=False)
    assert [x["field"] for x in e.value.errors] == ["line 1"], e.value.errors
    with pytest.raises(SpecError) as e:
        parse_records(b'{"prompt": "caf\xe9"}', prompts_allowed=True)
    assert e.value.errors[0]["message"] == "not UTF-8 text (byte 15 of the line)", e.value.errors
    kept = parse_records((GOOD + "\n" + PAIRED + "\n").encode(), prompts_allowed=False)
    assert [line.encode("utf-8") for line in kept]  # the spool's UTF-8 write takes them


def test_a_continual_source_skips_such_a_record_and_a_file_that_is_not_records(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(GOOD + "\n" + LONE + "\n")
    pq.write_table(pa.table({"foo": [1, 2]}), src / "b.parquet")  # no messages or prompt column
    (src / "c.parquet").write_bytes(b"garbage")  # no parquet at all
    pq.write_table(pa.table({"prompt": ["hello"]}), src / "d.parquet")
    watcher = SourceWatcher([(src, "src", [str(tmp_path)])], None)
    seen: list = []
    for _ in range(3):  # whole files are read once they held still over a poll
        seen += watcher.poll()
    values = {r.source: r.value for r in seen}
    assert values["src/a.jsonl:1"]["messages"][1]["content"] == "a"
    assert isinstance(values["src/a.jsonl:2"], DatasetError) and LONE_SURROGATE in str(values["src/a.jsonl:2"])
    for name in ("b", "c"):
        assert isinstance(values[f"src/{name}.parquet"], DatasetError), values
        assert f"{name}.parquet" in str(values[f"src/{name}.parquet"])
    assert values["src/d.parquet row 1"] == {"prompt": "hello"}
    # reported once, then passed over (a resumed job's cursor too)
    assert list(watcher.poll()) == []
    assert list(SourceWatcher([(src, "src", [str(tmp_path)])], watcher.cursor()).poll()) == []
    # one that was caught mid-write is read once its writer finishes it (its size changes)
    pq.write_table(pa.table({"prompt": ["late"]}), src / "c.parquet")
    later: list = []
    for _ in range(3):
        later += watcher.poll()
    assert [r.value for r in later] == [{"prompt": "late"}]


def test_a_byte_order_mark_on_the_ingest_route_is_taken():
    assert parse_records(b"\xef\xbb\xbf" + GOOD.encode() + b"\n", prompts_allowed=False) == [
        json.dumps(json.loads(GOOD), separators=(",", ":"))
    ]


def test_chat_template_kwargs_with_one_are_a_422_naming_the_field():
    from service.jobs.schemas import JobSpec

    with pytest.raises(Exception) as e:
        JobSpec.model_validate({"datasets": ["builtin://train"], "chat_template_kwargs": {"x": "\ud800"}})
    assert "chat_template_kwargs" in str(e.value) and "surrogate" in str(e.value)
