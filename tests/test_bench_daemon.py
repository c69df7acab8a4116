"""bench.daemon_gpu reads a start's compile figures from the daemon's own log lines (the text
formatter's `message key=value ...`), as the engine writes them."""

from __future__ import annotations

import logging

import pytest

from bench.daemon_gpu import (
    cold_label,
    empty_caches,
    log_figures,
    median_rows,
    start_names,
    start_row,
    step_figures,
)
from bench.daemon_gpu import main as daemon_gpu_main
from dflash_core.data_home import BYTECODE_DIR
from dflash_core.engine.pipeline import QUEUE_DEPTH
from service.logs import TextFormatter


def line(message: str, **fields) -> str:
    record = logging.LogRecord("dflash.engine", logging.INFO, __file__, 1, message, None, None)
    record.fields = fields
    return TextFormatter().format(record)


def test_a_cold_starts_side_compile_and_warm_up_from_its_log(tmp_path):
    log = tmp_path / "daemon_cold.log"
    log.write_text(
        "\n".join(
            [
                line(
                    "drafter compiled beside the target", ok=True, fxgraph_cache_miss=4.0, device="cuda:0", seconds=17.7
                ),
                line(
                    "drafter compiled beside the target",
                    ok=True,
                    device="cuda:1",
                    seconds=19.25,
                    async_compile_cache_miss=122.0,
                ),
                line("the drafter compile beside the target failed; compiling here", ok=False, device="cuda:2"),
                line(
                    "drafter warm-up compiles",
                    device="cuda:0",
                    seconds=1.699,
                    fxgraph_cache_hit=4.0,
                    fxgraph_cache_miss=0.0,
                ),
                line(
                    "drafter warm-up compiles",
                    device="cuda:1",
                    seconds=1.5,
                    fxgraph_cache_hit=4.0,
                    fxgraph_cache_miss=1.0,
                ),
            ]
        )
    )
    with log.open("a") as f:  # the target's two devices: its warm-up ends with the later one
        events = (
            "progress:loading_target:0@1.5 build:transformers_imported@3.25 progress:warming_target:0@3.5"
            " build:target_warm:cuda:0@20.0 build:target_warm:cuda:1@21.25"
        )
        f.write("\n" + line("engine build timeline", engine_created_after_seconds=1.2, events=events) + "\n")
        fields = dict(data_open=0.46, first_step=0.415, total=0.883)
        f.write(line("job's first step", **{f"{k}_s": v for k, v in fields.items()}) + "\n")
    assert log_figures(log) == {
        "side_s": 19.25,
        "side_kernels": 122,
        "side_failed": 1,
        "warmup_s": 3.2,
        "hit": 8.0,
        "miss": 1.0,
        "target_s": 17.75,
        "transformers_s": 1.75,
        "first_step_s": 0.415,
        "to_first_step_s": 0.883,
    }
    assert log_figures(tmp_path / "missing.log") == {}


def test_a_start_row_reads_the_jobs_first_step_from_the_log_after_the_job(tmp_path):
    """The daemon logs the job's first step while the job runs, after ready: the row reads the
    log once the job is done, so a cold start's row carries it."""
    log = tmp_path / "daemon_cold.log"
    log.write_text(line("drafter compiled beside the target", ok=True, seconds=16.5) + "\n")

    def job() -> dict:
        with log.open("a") as f:
            f.write(line("job's first step", first_step_s=0.41, total_s=0.85) + "\n")
        return {"state": "SUCCEEDED", "step_ms": 140.6}

    row = start_row("cold", 23.06, log, job)
    assert row == {
        "cache": "cold",
        "ready_s": 23.1,
        "state": "SUCCEEDED",
        "step_ms": 140.6,
        "side_s": 16.5,
        "side_kernels": 0,
        "first_step_s": 0.41,
        "to_first_step_s": 0.85,
    }
    assert "first_step_s" not in start_row("warm1", 9.4, tmp_path / "daemon_warm1.log", None)


def test_the_step_figures_leave_out_the_first_steps_and_the_pipelines_drain():
    # the shape of a colocated 20-step job: one slow first step, the steady steps with the target's
    # capture beside the drafter, then as many drafter-only steps as the captures ran ahead
    drain = QUEUE_DEPTH + 1
    seconds = [0.34] + [0.143] * (19 - drain) + [0.094] * drain
    steps = [{"step_seconds": s, "context_tokens": 3000} for s in seconds]
    figures = step_figures(steps)
    assert figures["step_ms"] == 143.0
    assert figures["drain_step_ms"] == 94.0
    assert figures["tokens_per_s"] == round(3000 / 0.143)


def test_a_job_too_short_for_a_steady_window_has_no_step_figure():
    steps = [{"step_seconds": 0.14, "context_tokens": 3000} for _ in range(10)]
    figures = step_figures(steps)
    assert figures["step_ms"] is None and figures["tokens_per_s"] is None
    assert figures["drain_step_ms"] == 140.0


def test_the_starts_are_named_cold_then_warm():
    assert start_names(1, 1) == ["cold", "warm"]
    assert start_names(1, 0) == ["cold"]
    assert start_names(3, 2) == ["cold1", "cold2", "cold3", "warm1", "warm2"]


def test_each_cold_start_finds_the_compile_and_bytecode_caches_empty(tmp_path):
    (tmp_path / "inductor" / "fxgraph").mkdir(parents=True)
    (tmp_path / "inductor" / "fxgraph" / "entry").write_text("graph")
    bytecode = tmp_path / "data" / BYTECODE_DIR
    bytecode.mkdir(parents=True)
    (bytecode / "stale.pyc").write_bytes(b"x")
    assert empty_caches(tmp_path, bytecode_kept=False) is None
    assert not (tmp_path / "inductor").exists() and not bytecode.exists()


def test_fewer_than_one_cold_start_is_refused(capsys):
    with pytest.raises(SystemExit):
        daemon_gpu_main(["--cold-starts", "0"])
    assert "--cold-starts" in capsys.readouterr().err


def test_cold_rows_say_what_their_caches_held_and_get_a_median_of_their_own():
    assert cold_label("cold", precompile=False, bytecode_kept=True) == "cold (bytecode kept)"
    assert cold_label("cold2", precompile=True, bytecode_kept=True) == "after precompile (cold2)"
    rows = [
        {"cache": "cold1", "ready_s": 40.0, "cold_start": True},
        {"cache": "cold2", "ready_s": 44.0, "cold_start": True},
        {"cache": "cold3", "ready_s": 41.0, "cold_start": True},
        {"cache": "warm1", "ready_s": 14.0, "env": "-"},
        {"cache": "warm2", "ready_s": 15.0, "env": "A=1"},
        {"cache": "warm3", "ready_s": 16.0, "env": "-"},
    ]
    assert median_rows(rows, ["", "A=1"]) == [
        {"cache": "cold median of 3", "ready_s": 41.0},
        {"cache": "warm median of 2", "ready_s": 15.0, "env": "-"},
    ]
