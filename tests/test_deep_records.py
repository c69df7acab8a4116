"""A deeply nested record is a bad record naming its place in every layout, never a bare
RecursionError: JSON lines (even past the JSON reader's own recursion limit), JSON arrays and
parquet rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data.conversations import DatasetError, read_conversations
from dflash_core.data.inspect import check_dataset

GOOD = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


def _deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [40, 300, 5000])
def test_deep_json_lines_and_array_elements(tmp_path, depth):
    deep = '{"messages": [{"role": "user", "content": "a", "x": ' + "[" * depth + "]" * depth + "}]}"
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps(GOOD) + "\n" + deep + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: JSON nested deeper than 32 levels"):
        check_dataset(lines)
    assert len(list(read_conversations(lines, skip_bad_lines=True))) == 2
    array = tmp_path / "d.json"
    array.write_text("[" + json.dumps(GOOD) + ",\n" + deep + "]")
    with pytest.raises(DatasetError, match="nested deeper than 32 levels"):
        check_dataset(array)


def test_deep_parquet_rows(tmp_path):
    deep_type = pa.int64()
    for _ in range(41):
        deep_type = pa.list_(deep_type)
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("x", deep_type)])
    user, answer = {"role": "user", "content": "a", "x": None}, {"role": "assistant", "content": "b", "x": None}
    messages = pa.array([[{**user, "x": _deep_list(40)}, answer], [user, answer]], type=pa.list_(message))
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"messages": messages}), path)
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: nested deeper than 32 levels"):
        check_dataset(path)
    assert len(list(read_conversations(path, skip_bad_lines=True))) == 1
