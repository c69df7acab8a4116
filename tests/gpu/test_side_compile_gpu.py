"""A cold start's drafter compile beside the target, on CUDA (dflash_core/engine/side_compile.py):
`precompile` on an empty data directory starts a child for the drafter GPU, the child compiles
the drafter's step, and the build's own drafter warm-up then finds every graph in the cache; the
next build on that directory starts no child."""

from __future__ import annotations

import json

import pytest

from tests.test_compile_cache import precompile

pytestmark = pytest.mark.gpu


def records(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "message" in record:
            out.append(record)
    return out


def named(stderr: str, message: str) -> list[dict]:
    return [r for r in records(stderr) if r["message"] == message]


def test_a_cold_build_compiles_its_drafter_beside_the_target(tmp_path):
    config = tmp_path / "dflash.toml"
    config.write_text(f'log_json = true\ndata_dir = "{tmp_path / "data"}"\n')
    cold = precompile("--config", str(config), cwd=tmp_path)
    assert cold.returncode == 0, cold.stderr[-3000:]
    [side] = named(cold.stderr, "drafter compiled beside the target")
    assert side["ok"] and side["step_graph"] and side["fxgraph_cache_miss"] >= 1, side
    [warm_up] = named(cold.stderr, "drafter warm-up compiles")
    # every graph the build's drafter warm-up needed, the child had compiled
    assert warm_up["fxgraph_cache_miss"] == 0 and warm_up["fxgraph_cache_hit"] >= 1, warm_up
    assert not named(cold.stderr, "the drafter compile beside the target failed; compiling here")
    again = precompile("--config", str(config), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [r for r in records(again.stderr) if "beside the target" in r["message"]]
