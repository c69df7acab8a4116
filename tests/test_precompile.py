"""Compile helpers: a child process compiling the step fills the very cache entries the engine's
own warmup then loads (on CPU here: inductor's C++ path, the same cache machinery; the GPU run
with two drafter GPUs is in docs/benchmarks.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE_SCRIPT = """
import json, sys
from dflash_core.config import ShapeConfig
from dflash_core.defaults import DEFAULT_DRAFTER_LAYERS, DEFAULT_TARGET_LAYER_IDS
from dflash_core.engine import Engine, EngineConfig

cfg = EngineConfig(drafter_devices=["cpu"], shape=ShapeConfig(seq_len=128, num_anchors=16, block_size=8),
                   drafter_layers=DEFAULT_DRAFTER_LAYERS, target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
                   compile=True)
engine = Engine(cfg, sys.argv[2])
if sys.argv[1] == "spec":
    engine.load_target_config()
    print(json.dumps(engine.compile_helper_spec()))
else:
    engine.build()
    from torch._dynamo.utils import counters
    print(json.dumps({"warmup_graphs": engine.compile_counts()["warmup"], **{k: counters[g][k] for g, k in (
        ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_hit"))}}))
"""


def _run(args, cache_dir, timeout=600):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_helper_compiles_exactly_what_the_engine_warmup_loads(tmp_path, default_assets):
    data_dir = str(default_assets.root.parent.parent)
    cache = tmp_path / "inductor"
    spec = _run(["-c", ENGINE_SCRIPT, "spec", data_dir], cache)
    helper = _run(["-m", "dflash_core.engine.precompile", json.dumps(dict(spec, device="cpu"))], cache)
    assert helper["fxgraph_cache_miss"] > 0  # it compiled
    engine = _run(["-c", ENGINE_SCRIPT, "build", data_dir], cache)
    assert engine["warmup_graphs"] > 0
    # every graph the engine compiled came from the helper's entries
    assert engine["fxgraph_cache_miss"] == 0, engine
    assert engine["fxgraph_cache_hit"] + engine["autograd_cache_hit"] > 0, engine
