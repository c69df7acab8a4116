"""Past the engine's recompile limit a compiled frame fails instead of running eagerly: dynamo's
default is to run the frame uncompiled from then on without a word, which for the drafter's
layer means an ungraphed step and flex_attention traced eagerly in the drafter threads. Both cases
run in one fresh interpreter (dynamo's config and caches are per process, and the test process's
must stay as they are): dynamo's default first, then the engine's setting, with dynamo's compiled
entries reset in between so that the second case fills the limit from nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import torch
from dflash_core.engine.compile import raise_recompile_limit

def probe():
    limit = torch._dynamo.config.recompile_limit
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    for n in range(1, limit + 1):  # one compiled entry per shape fills the limit
        f(torch.ones(n))
    try:
        f(torch.ones(limit + 1))
        print("ran", limit)
    except Exception as e:
        print(type(e).__name__, limit)

probe()  # dynamo's own default
torch._dynamo.reset()
raise_recompile_limit(1)
probe()  # the engine's setting
"""


@pytest.mark.slow  # a fresh interpreter that imports dynamo
def test_the_engines_limit_fails_loudly_where_dynamo_would_run_eagerly():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    default, engine = (line.split() for line in out.stdout.splitlines()[-2:])
    assert default[0] == "ran"  # dynamo's own default: the frame runs uncompiled
    outcome, limit = engine
    assert outcome == "FailOnRecompileLimitHit" and int(limit) == 8
