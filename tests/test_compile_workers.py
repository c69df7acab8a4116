"""start_compile_workers says whether inductor's worker pool really started (the engine's build
timeline marks it only then). Each case runs in a fresh interpreter: the pool lives per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")  # inductor uses no worker pool without Triton

PROBE = "from dflash_core.engine.compile import start_compile_workers; print(start_compile_workers())"


def started(**env: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.slow  # a fresh interpreter per case
@pytest.mark.parametrize("env", [{"TORCHINDUCTOR_COMPILE_THREADS": "1"}, {"TORCH_WARM_POOL": "0"}])
def test_no_pool_where_torch_uses_none(env):
    assert started(**env) is False


@pytest.mark.slow  # a fresh interpreter that starts inductor's compile pool
def test_pool_starts_with_two_compile_threads():
    assert started(TORCHINDUCTOR_COMPILE_THREADS="2", TORCH_WARM_POOL="1") is True
