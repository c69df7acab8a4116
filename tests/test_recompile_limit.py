"""Past the engine's recompile limit a compiled frame fails instead of running eagerly: dynamo's
default is to run the frame uncompiled from then on without a word, which for the drafter's
layer means an ungraphed step and flex_attention traced eagerly in the drafter threads. Each case
runs in a fresh interpreter (dynamo's config and caches are per process)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import torch
from dflash_core.engine.compile import raise_recompile_limit
if {engine}:
    raise_recompile_limit(1)
limit = torch._dynamo.config.recompile_limit
f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
for n in range(1, limit + 1):  # one compiled entry per shape fills the limit
    f(torch.ones(n))
try:
    f(torch.ones(limit + 1))
    print("ran", limit)
except Exception as e:
    print(type(e).__name__, limit)
"""


def probe(engine: bool) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(engine=engine)], capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout.split()


def test_the_engines_limit_fails_loudly_where_dynamo_would_run_eagerly():
    assert probe(engine=False)[0] == "ran"  # dynamo's own default: the frame runs uncompiled
    outcome, limit = probe(engine=True)
    assert outcome == "FailOnRecompileLimitHit" and int(limit) == 8
