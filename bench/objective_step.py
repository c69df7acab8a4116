"""The drafter step of each objective at the reference shape (docs/design.md) on one GPU.

    python -m bench.objective_step [--layers 5] [--iters 20] [--objectives ce_daemon,ce,kl,tv,ce_tv,dpace,dspark]
        [--precision fp8] [--profile]

Each row times forward + backward through the engine's replica (compiled layers, the engine's
loss kernel) and, with --graph, replays of the recorded step (step_graph.StepGraph), as a
daemon steps: `ce_daemon` is the block CE step of an engine without the teacher; the others
run the objective step (features with the target's final hidden states appended), with their
mix and position weights; `dspark` runs the DSpark recipe (block 7, Markov rank 256, 512
anchors). Reports the median ms, the ratio to ce_daemon, peak and steady reserved memory, the
reserved swing over --flat-steps full steps, and the compiles counted after the first row. Writes
$OUT/objective_step.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace

import torch

from bench.common import (
    REFERENCE_SHAPE,
    cuda_time_ms,
    env_record,
    out_dir,
    pid_alive,
    reference_drafter_config,
    timing_fields,
)
from bench.drafter_step import ENGINE, FP8, profile
from dflash_core.config import ShapeConfig
from dflash_core.data.batches import synthetic_micro_batch
from dflash_core.drafter import FrozenHead
from dflash_core.engine.replica import DrafterReplica, ReplicaStep
from dflash_core.engine.step_graph import StepGraph, matches_eager
from dflash_core.step.objectives import objective_of

OBJECTIVES = {  # name -> (loss mix or None (the CE daemon), position weights, recipe)
    "ce_daemon": (None, "decay", "dflash"),
    "ce": ({"ce": 1.0}, "decay", "dflash"),
    "kl": ({"kl": 1.0}, "decay", "dflash"),
    "tv": ({"tv": 1.0}, "decay", "dflash"),
    "ce_tv": ({"ce": 0.1, "tv": 0.9}, "decay", "dflash"),
    "dpace": ({"ce": 1.0}, "dpace", "dflash"),
    "dspark": ({"ce": 0.1, "tv": 0.9, "conf": 1.0}, "decay", "dspark"),
}


def compile_count() -> int:
    from dflash_core.engine.compile import compiled_graphs

    return compiled_graphs()


def inputs(cfg, shape, teacher: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
    )
    batch = synthetic_micro_batch(shape, cfg.vocab_size, 0).to("cuda")
    width = (cfg.num_target_features + int(teacher)) * cfg.hidden_size
    feats = torch.randn(shape.seq_len, width, device="cuda", dtype=torch.bfloat16, generator=g)
    return head, batch, feats


def run(
    name,
    layers,
    iters,
    chunk,
    graph: bool,
    wait_pid: int = 0,
    compile_only: bool = False,
    flat_steps: int = 30,
    plan=ENGINE,
    profile_steps: bool = False,
):
    mix, weights, recipe = OBJECTIVES[name]
    teacher = mix is not None
    cfg = reference_drafter_config(layers)
    shape = REFERENCE_SHAPE
    gamma = 7.0
    if recipe == "dspark":
        cfg = replace(cfg, block_size=7, recipe="dspark", markov_rank=256)
        shape = ShapeConfig(seq_len=shape.seq_len, num_anchors=shape.num_anchors, block_size=7)
        gamma = float("inf")
    head, batch, feats = inputs(cfg, shape, teacher)
    rep = DrafterReplica(0, cfg, "cuda:0", head, plan, ReplicaStep(gamma, chunk, teacher=teacher))
    rep.init_weights(0)
    if teacher:
        rep.objective.set(objective_of(mix, weights, 0.5))
    t0 = time.perf_counter()
    rep.new_optimizer(1e-4, 0.0, (0.9, 0.95))

    def step():
        rep.forward_backward(batch, feats, 1.0, rep.new_accumulator())
        rep.clip_and_step(1.0, 1e-4)

    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    if compile_only:  # fills the compile caches for a later run
        return {"objective": name, "compiled_in_s": round(first_s, 1)}
    matches = None
    if graph:
        rep.zero_grad()
        rep.step_graph = StepGraph(rep, batch, feats)
        # as the engine keeps a graph: its replay of another micro-batch equals the eager step
        other = synthetic_micro_batch(shape, cfg.vocab_size, 0, seed=1).to("cuda")
        matches = matches_eager(rep.step_graph, rep, other, torch.roll(feats, 1, 0))
    while wait_pid and pid_alive(wait_pid):  # a compiling process beside this one: time nothing yet
        time.sleep(1)
    compiles_before = compile_count()
    torch.cuda.reset_peak_memory_stats()

    def fwd_bwd():
        rep.zero_grad()
        rep.forward_backward(batch, feats, 1.0, rep.new_accumulator())

    times = cuda_time_ms(fwd_bwd, warmup=3, iters=iters)
    if profile_steps:  # after the timing, so the profiler's overhead is not in it
        profile(rep, batch, feats, name, table=True)
    rep.zero_grad()  # the timed calls leave their gradients: a step starts from none
    reserved = []
    for _ in range(flat_steps):
        step()
        reserved.append(torch.cuda.memory_reserved())
    torch.cuda.synchronize()
    return {
        "objective": name,
        "recipe": recipe,
        "block_size": shape.block_size,
        "graph": graph and rep.step_graph is not None,
        "graph_matches_eager": matches,
        **timing_fields(times),
        "first_step_s": round(first_s, 1),
        "reserved_swing_pct": round(100 * (max(reserved) - min(reserved)) / max(reserved), 3),
        "compiles_while_timed": compile_count() - compiles_before,
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--graph", action="store_true", help="replay the recorded step, as the daemon does")
    p.add_argument("--wait-pid", type=int, default=0, help="time nothing until this process has exited")
    p.add_argument("--compile-only", action="store_true", help="compile each row's step, time nothing")
    p.add_argument("--flat-steps", type=int, default=30, help="full steps over which the reserved swing is taken")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="the engine's [engine] precision")
    p.add_argument("--profile", action="store_true", help="device time per kernel class and the top kernels per row")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name in args.objectives.split(","):
        try:
            row = run(
                name,
                args.layers,
                args.iters,
                args.chunk,
                args.graph,
                args.wait_pid,
                args.compile_only,
                args.flat_steps,
                FP8 if args.precision == "fp8" else ENGINE,
                args.profile,
            )
        except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
            row = {"objective": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir() / "objective_step.json").write_text(json.dumps({"env": env_record(), "rows": rows}, indent=1))
        gc.collect()
        torch.cuda.empty_cache()
    base = next((r["median_ms"] for r in rows if r.get("objective") == "ce_daemon" and "median_ms" in r), None)
    for r in rows:
        if base and "median_ms" in r:
            r["vs_ce_daemon"] = round(r["median_ms"] / base, 3)
    (out_dir() / "objective_step.json").write_text(json.dumps({"env": env_record(), "rows": rows}, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
