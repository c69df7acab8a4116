"""The configured compile cache is the one used: an engine created with a data directory (and no
exported variable) points inductor at <data_dir>/inductor-cache before anything imports dynamo,
so what the process compiles lands there and a second process loads it from there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.compiled_graphs import inventory
from tests.helpers import REPO_ROOT as REPO
from tests.helpers import run_cli, run_code

PROBE = """
import json, sys
if "--serve-imports" in sys.argv:  # what `serve` imports before torch: the web stack, multiprocessing with it
    import fastapi, uvicorn
from dflash_core.engine import Engine, EngineConfig
from dflash_core.engine.compile import load_artifacts, save_artifacts
from pathlib import Path
Engine(EngineConfig(drafter_devices=["cpu"], target_devices=["cpu"]), sys.argv[1])  # no build: the cache is set here
import torch
if "--load-artifacts" in sys.argv:
    assert load_artifacts(Path(sys.argv[sys.argv.index("--load-artifacts") + 1]))
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir
if "--resolve-only" not in sys.argv:
    from dflash_core.fp8 import Fp8Linear
    linear = torch.nn.Linear(32, 32, bias=False).bfloat16()
    linear.__class__ = Fp8Linear  # as fp8.use_fp8_linears makes the FP8 drafter's layers
    fn = torch.compile(lambda x: torch.sin(linear(x)) * 3 + x.cos(), dynamic=False)
    fn(torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
if "--save-artifacts" in sys.argv:
    assert save_artifacts(Path(sys.argv[sys.argv.index("--save-artifacts") + 1])) > 0
aot = counters["aot_autograd"]
print(json.dumps({"cache_dir": cache_dir(), "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hits": aot["autograd_cache_hit"], "aot_bypasses": aot["autograd_cache_bypass"]}))
"""


def run_probe(data_dir: Path, env: dict[str, str], *flags: str) -> dict:
    """An engine created in a fresh interpreter, then inductor's cache directory and its hits and
    misses for one compiled function with an FP8 linear, forward and backward (--resolve-only: the
    directory alone, nothing compiled)."""
    return run_code(PROBE, str(data_dir), *flags, env=env)


@pytest.mark.slow  # three fresh interpreters and C++ compiles: about 20 s on 2 cores
def test_the_data_dirs_cache_is_filled_then_hit(tmp_path):
    """The second process hits every graph the first compiled, although it imported the web
    stack before torch and the first did not (`serve` after `precompile`); so does a process
    whose empty cache was filled from the first one's portable artifacts."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(REPO)
    artifacts = tmp_path / "compile-artifacts.bin"
    cold = run_probe(tmp_path / "data", env, "--save-artifacts", str(artifacts))
    cache = tmp_path / "data" / "inductor-cache"
    assert Path(cold["cache_dir"]) == cache and cold["misses"] >= 1 and cold["hits"] == 0
    assert any(cache.rglob("*")), "nothing was written to the data directory's cache"
    # what it compiled, graph by graph (bench.compiled_graphs reads the output code inductor
    # wrote there): the function's training forward and its backward, each with its own kernels
    graphs = inventory(cache)
    assert sorted(g.kind for g in graphs) == ["backward", "forward"] and all(g.kernels for g in graphs), graphs
    # a restart with the same data volume, importing what `serve` imports before torch where the
    # first process did not (as `precompile` does not): the keys do not depend on it
    warm = run_probe(tmp_path / "data", env, "--serve-imports")
    assert warm["hits"] >= 1 and warm["misses"] == 0
    # the FP8 linear (a custom operator) does not keep AOTAutograd's cache from the graph: a warm
    # start loads its forward-backward split instead of tracing the joint graph again
    assert cold["aot_bypasses"] == 0 and warm["aot_bypasses"] == 0 and warm["aot_hits"] >= 1
    # another machine's empty cache filled from the first process's portable artifacts (what
    # `precompile` writes beside its cache): its graphs are hits too
    shipped = run_probe(tmp_path / "elsewhere", env, "--serve-imports", "--load-artifacts", str(artifacts))
    assert shipped["hits"] >= 1 and shipped["misses"] == 0 and shipped["aot_hits"] >= 1, shipped


def test_an_exported_variable_wins(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine"))
    # inductor writes where cache_dir() points (test_the_data_dirs_cache_is_filled_then_hit): no compile needed
    assert Path(run_probe(tmp_path / "data", env, "--resolve-only")["cache_dir"]) == tmp_path / "mine"
    assert not (tmp_path / "data" / "inductor-cache").exists()


def precompile(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`dflash-trainer precompile ARGS` in a fresh interpreter, with no cache variable exported."""
    return run_cli("precompile", *args, cwd=cwd, timeout=300, drop=("DFLASH_", "TORCHINDUCTOR_", "TRITON_"))


@pytest.mark.slow  # two precompile runs in fresh interpreters
def test_precompile_builds_without_serving_and_stale_artifacts_are_skipped(tmp_path):
    """`dflash-trainer precompile` warms the engine of a config into its data directory and exits
    (nothing is compiled on the CPU, so no artifacts); a later build that finds unreadable
    artifacts there logs it and builds as usual."""
    data = tmp_path / "data"
    out = precompile("--data-dir", str(data), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["data_dir"] == str(data) and summary["compiled_graphs"] == 0 and summary["drafters"] == ["cpu"]
    assert (data / "inductor-cache").is_dir()
    assert "python bytecode: " in out.stderr  # where the libraries' bytecode is kept, and why
    (data / "compile-artifacts.bin").write_bytes(b"not artifacts")
    out = precompile("--data-dir", str(data), cwd=tmp_path)
    assert out.returncode == 0 and "not loaded" in out.stderr, out.stderr[-3000:]
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\ncompile_scope = 'layer'\n")
    out = precompile("--config", str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "engine.compile_scope" in out.stderr
