"""Compile helpers: one child process per extra drafter device fills the on-disk compile caches.

The main thread still warms every drafter itself, one device at a time (DESIGN.md section 2: threads
that compile at once deadlock). But inductor's graph cache is keyed on the device index, so on
torch 2.11 the second drafter GPU cannot reuse the first one's compiled graphs: a fresh 2x H200 spent
48.9 s compiling cuda:0 and another 34.2 s compiling cuda:1 (run J). A child process has its own
dynamo, so it can compile the same step for cuda:1 while the main thread compiles cuda:0; when the
main thread reaches cuda:1, its compile finds every graph in the cache.

The child builds a replica with the engine's own classes and runs the engine's own warm step
(`DrafterReplica.warm_step`) on the synthetic batch at the production shape, with random head
weights and random features of the target's shapes and dtype: the compiled graphs depend on shapes,
dtypes and devices, never on values. It needs room for one more training step on its device while the
build runs (about 25 GB at the reference shape) and exits before the engine is ready.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dflash.engine")


@dataclass
class CompileHelper:
    """A running child process that compiles one device's step."""

    device: str
    process: subprocess.Popen
    log_path: Path
    started: float

    def wait(self, timeout: float) -> bool:
        """True if the child finished cleanly within `timeout` seconds. Otherwise (failed, or still
        running: then it is killed) the main thread compiles this device itself, as without a helper."""
        try:
            code = self.process.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            log.warning("compile helper for %s still running after %.0f s: killed; compiling in the main thread",
                        self.device, time.monotonic() - self.started)
            return False
        if code != 0:
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.is_file() else ""
            log.warning("compile helper for %s exited with %d; compiling in the main thread. Its log ends:\n%s",
                        self.device, code, tail)
            return False
        return True

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_helpers(spec: dict, devices: list[str], log_dir: Path) -> list[CompileHelper]:
    """One child per device in `devices`, each running `python -m dflash_core.engine.precompile`
    with `spec` (the replica's settings) and the parent's environment (the same cache directories)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(__file__).resolve().parents[2])  # where this dflash_core is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    helpers = []
    for device in devices:
        log_path = log_dir / f"compile-helper-{device.replace(':', '')}.log"
        with open(log_path, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "dflash_core.engine.precompile", json.dumps(dict(spec, device=device))],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        helpers.append(CompileHelper(device, process, log_path, time.monotonic()))
    return helpers


def replica_spec(drafter_config, shape, *, attention: str, compile_scope: str, flex_q_splits: int, gamma: float,
                 chunk_size: int, pad_token_id: int) -> dict:
    """Everything a child needs to build the replica the engine builds (JSON)."""
    return {"drafter_config": drafter_config.to_dict(), "shape": [shape.seq_len, shape.num_anchors, shape.block_size],
            "attention": attention, "compile_scope": compile_scope, "flex_q_splits": flex_q_splits, "gamma": gamma,
            "chunk_size": chunk_size, "pad_token_id": pad_token_id}


def run_spec(spec: dict) -> float:
    """Build the replica of `spec` on spec["device"] and run one warm step; its seconds."""
    import torch

    from ..config import DrafterConfig, ShapeConfig
    from ..data.batches import synthetic_micro_batch
    from ..devices import compute_dtype
    from ..train_step import FrozenHead
    from .replica import DrafterReplica

    t0 = time.monotonic()
    cfg = DrafterConfig(**dict(spec["drafter_config"], target_layer_ids=tuple(spec["drafter_config"]["target_layer_ids"])))
    shape = ShapeConfig(*spec["shape"])
    device = torch.device(spec["device"])
    dtype = compute_dtype(device)
    with torch.device(device):
        head = FrozenHead(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype) * 0.02,
                          torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype) * 0.02)
        features = torch.randn(shape.seq_len, cfg.num_target_features * cfg.hidden_size, dtype=dtype)
    rep = DrafterReplica(0, cfg, str(device), head, attention=spec["attention"], compiled=True, compute_dtype=dtype,
                         gamma=spec["gamma"], chunk_size=spec["chunk_size"], compile_scope=spec["compile_scope"],
                         flex_q_splits=spec["flex_q_splits"])
    batch = synthetic_micro_batch(shape, cfg.vocab_size, spec["pad_token_id"])
    rep.warm_step(batch, features)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    seconds = run_spec(spec)
    from torch._dynamo.utils import counters  # what came from the cache and what was compiled here

    inductor = counters["inductor"]
    print(json.dumps({"device": spec["device"], "compiled_and_ran_seconds": round(seconds, 1),
                      "fxgraph_cache_hit": inductor["fxgraph_cache_hit"], "fxgraph_cache_miss": inductor["fxgraph_cache_miss"]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
