"""bench/graph_pool.py's arguments, refused before any GPU work (the bench itself needs CUDA), and
the benchmarks' tables (bench/tables.py)."""

import pytest
import torch

from bench.graph_pool import main


@pytest.mark.parametrize("flag", ["--layers", "--slots", "--ride", "--length"])
def test_a_count_below_one_is_refused(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main([flag, "0"])
    assert e.value.code == 2
    assert "take positive counts" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_table_has_every_rows_columns_in_the_order_they_first_appear(capsys):
    from bench.tables import columns_of, print_table

    rows = [{"a": 1, "b": 22}, {"a": 3, "error": "OutOfMemoryError"}, {"c": 4, "b": 5}]
    cols = columns_of(rows)
    assert cols == ["a", "b", "error", "c"]
    print_table(rows, cols)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[-1].strip() == "c" and "OutOfMemoryError" in lines[3]
    assert len({len(line) for line in lines[2:]}) == 1  # every row as wide as the others
