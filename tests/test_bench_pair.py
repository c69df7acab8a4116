"""bench.daemon_pair: the runs' order, its table from real daemon_gpu records (an H200 pair's), the
trees it refuses, and a whole run on the CPU where the daemons cannot start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.daemon_pair import main, pair_row, parse_trees, run_one, run_order
from tests.helpers import REPO_ROOT

FIXTURES = Path(__file__).parent / "fixtures" / "daemon_pair"


def test_each_precision_runs_the_trees_in_the_other_order():
    assert run_order(["after", "before"], ["fp8", "bf16"]) == [
        ("after", "fp8"),
        ("before", "fp8"),
        ("before", "bf16"),
        ("after", "bf16"),
    ]
    assert run_order(["a", "b"], ["bf16"]) == [("a", "bf16"), ("b", "bf16")]


def test_a_row_is_the_cold_start_with_the_job_and_the_warm_start():
    record = json.loads((FIXTURES / "h200_after_fp8.json").read_text())
    row = pair_row(record, "after", "fp8", 1)
    assert row == {
        "daemon": "fp8",
        "tree (order)": "after (1)",
        "cold ready": "24.1 s",
        "warm ready": "9.4 s",
        "compile child (kernels)": "16.89 s (92)",
        "target's warm-up": "8.36 s",
        "job start to first step (first step)": "0.85 s (0.388 s)",
        "step": "131.5 ms",
        "steps/s": "7.60",
        "anchor updates/s": "3,894",
        "runtime compiles": "0",
        "reserved swing": "0.1 %",
    }
    bf16 = pair_row(json.loads((FIXTURES / "h200_before_bf16.json").read_text()), "before", "bf16", 3)
    assert (bf16["cold ready"], bf16["warm ready"], bf16["steps/s"]) == ("21.8 s", "9.7 s", "5.46")


def test_a_failed_job_is_said_in_its_row():
    record = json.loads((FIXTURES / "h200_before_bf16.json").read_text())
    record["rows"][0]["state"] = "FAILED"
    row = pair_row(record, "before", "bf16", 1)
    assert (row["step"], row["steps/s"], row["anchor updates/s"]) == ("job FAILED", "-", "-")
    assert row["cold ready"] == "21.8 s"  # the start itself is still a figure


def test_trees_are_named_directories_with_the_bench(tmp_path):
    assert parse_trees([f"before={REPO_ROOT}", "after=."]) == {"before": REPO_ROOT, "after": Path(".").resolve()}
    for specs, says in [
        ([str(REPO_ROOT), f"b={REPO_ROOT}"], "NAME=DIR"),
        ([f"a={REPO_ROOT}", f"a={REPO_ROOT}"], "twice"),
        ([f"a={REPO_ROOT}"], "two trees"),
        ([f"a={REPO_ROOT}", f"b={tmp_path}"], "no bench/daemon_gpu.py"),
        ([f"a/b={REPO_ROOT}", f"b={REPO_ROOT}"], "letters, digits"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_trees(specs)


@pytest.mark.slow  # two fresh interpreters that import torch
def test_a_whole_run_writes_its_table_where_no_daemon_starts(tmp_path, monkeypatch, capsys):
    """Each tree's own bench runs in its directory (`--help` here: it writes no record, so each row
    says where to look), and a deadline too close for a run skips it."""
    monkeypatch.setenv("OUT", str(tmp_path))
    main(["--tree", f"after={REPO_ROOT}", "--tree", f"before={REPO_ROOT}", "--precisions", "bf16", "--", "--help"])
    rows = json.loads((tmp_path / "daemon_pair.json").read_text())["rows"]
    assert [r["cold ready"] for r in rows] == ["no result: see after_bf16.log", "no result: see before_bf16.log"]
    assert "--bytecode-kept" in (tmp_path / "after_bf16.log").read_text()  # daemon_gpu's own help ran
    main(["--tree", f"after={REPO_ROOT}", "--tree", f"before={REPO_ROOT}", "--deadline", "5"])
    rows = json.loads((tmp_path / "daemon_pair.json").read_text())["rows"]
    assert [(r["daemon"], r["tree (order)"]) for r in rows] == [
        ("bf16", "after (1)"),
        ("bf16", "before (2)"),
        ("fp8", "before (3)"),
        ("fp8", "after (4)"),
    ]
    assert all(r["cold ready"].startswith("skipped: ") for r in rows)
    assert "the guarded figures, after and before on one host" in capsys.readouterr().out


@pytest.mark.slow  # a fresh interpreter that imports torch, cut off
def test_a_run_cut_off_is_killed_and_no_earlier_record_stands_for_it(tmp_path):
    label = tmp_path / "after_bf16"
    label.mkdir()
    (label / "daemon_gpu.json").write_text(json.dumps({"rows": []}))  # an earlier run's
    started = time.monotonic()
    assert run_one(REPO_ROOT, "after", "bf16", ["--colocated"], tmp_path, timeout=0.5) is None
    assert time.monotonic() - started < 30
    assert "after_bf16: cut off at 0 s" in (tmp_path / "after_bf16.log").read_text()
    assert not (label / "daemon_gpu.json").exists()
