"""bench.continual_ingest's windows: a step counts for the window it ran in, and neither window
counts the steps it cannot attribute (the warm-up, a window's first moments, a window's edge)."""

import subprocess
import sys
import time

import pytest

from bench.continual_ingest import WRITER, around, classify


def test_steps_count_for_their_window_only():
    steps = [
        (1.0, 1.1),  # in the warm-up
        (2.6, 2.7),  # quiet window 2 (even)
        (3.1, 3.2),  # the first 0.5 s of busy window 3
        (3.6, 3.8),  # busy window 3
        (3.9, 4.1),  # across the edge of windows 3 and 4
        (4.5, 4.6),  # quiet window 4
    ]
    kinds = classify(steps, window=1.0, settle=0.5, warmup=2.0)
    assert [round(d, 3) for d in kinds["quiet"]] == [0.1, 0.1]
    assert [round(d, 3) for d in kinds["busy"]] == [0.2]


def test_a_burst_is_read_from_the_steps_that_overlap_its_ingest():
    ends = [0.0, 1.0, 2.0, 3.0, 4.0, 4.5, 5.0, 8.0, 8.1]  # the file dropped at 4.2, read by 7.0
    got = around(ends, dropped=4.2, ingested=7.0, warmup=4.0)
    # before: steps starting from 2.0 and ending by 4.2 (1 s each); during: 4.0-4.5, 4.5-5.0, 5.0-8.0
    assert got["median_step_ms_before"] == 1000.0 and got["steps_during"] == 3
    assert got["longest_step_ms_during"] == 3000.0 and got["longest_excess_ms"] == 2000.0
    assert got["median_step_ms_during"] == 500.0 and got["ingest_s"] == 2.8


@pytest.mark.slow  # a writer process through two 2-second windows
def test_the_writer_appends_in_busy_windows_only(tmp_path):
    """The writer process appends nothing in the first (quiet) window and about the rate's records
    in the second (busy) one, catching up where it started late."""
    path = tmp_path / "live.jsonl"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "200", "2", str(t0)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(max(0.0, t0 + 1.5 - time.time()))
        quiet = path.read_text().count("\n") if path.exists() else 0
        read_in_time = time.time() < t0 + 2.0  # a loaded host may wake this thread late
        time.sleep(max(0.0, t0 + 4.3 - time.time()))
        busy = path.read_text().count("\n") if path.exists() else 0
        before_next_busy = time.time() < t0 + 6.0
    finally:
        proc.kill()
        proc.wait()
    assert quiet == 0 or not read_in_time
    assert busy >= 200, busy  # 2 s at 200 records/s, less what a late last wake-up missed
    assert busy <= 400 or not before_next_busy, busy
