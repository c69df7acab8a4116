"""start_compile_workers says whether inductor's worker pool really started (the engine's build
timeline marks it only then). Each case runs in a fresh interpreter: the pool lives per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")  # inductor uses no worker pool without Triton

# one call per argument, with TORCH_WARM_POOL set to it (torch reads it at each call; the compile
# thread count only when inductor's config is imported, so that one is set for the interpreter)
PROBE = """
import os, sys
from dflash_core.engine.compile import start_compile_workers
for warm in sys.argv[1:]:
    os.environ["TORCH_WARM_POOL"] = warm
    print(start_compile_workers())
"""


def started(*warm: str, **env: str) -> list[bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *warm],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [line == "True" for line in out.stdout.strip().splitlines()[-len(warm) :]]


@pytest.mark.slow  # a fresh interpreter
def test_no_pool_with_one_compile_thread():
    assert started("1", TORCHINDUCTOR_COMPILE_THREADS="1") == [False]


@pytest.mark.slow  # a fresh interpreter that starts inductor's compile pool
def test_pool_starts_with_two_compile_threads_and_not_with_the_warm_pool_off():
    """Two compile threads: no pool while TORCH_WARM_POOL is 0, then a pool once it is 1 (the
    first call started nothing the second could find)."""
    assert started("0", "1", TORCHINDUCTOR_COMPILE_THREADS="2") == [False, True]
