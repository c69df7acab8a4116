"""The child of side_compile.py: `python -m dflash_core.engine.side_compile_child BUILD_PID`
imports what a compile needs, then reads a SideSpec as one line of JSON on its standard input,
builds one drafter replica as the engine's build will, warms it on stand-ins for the target's
head and features (which fills the shared compile cache), and prints its result as the last
line of its output. It exits when the build's process does."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch

from ..config import DrafterConfig, ShapeConfig
from ..data.batches import synthetic_micro_batch
from ..drafter import FrozenHead
from .compile import (
    compile_delta,
    compile_snapshot,
    raise_recompile_limit,
    stable_graph_cache_keys,
)
from .config import StepPlan
from .replica import DrafterReplica, ReplicaStep
from .side_compile import RESULT_PREFIX, SideSpec
from .step_graph import record_step_graph
from .warmup import WARMUP_SEED, reset_weights, warm_replica


def run_child(spec: SideSpec) -> dict[str, Any]:
    """Build one replica as the build will, warm it on stand-ins, record its step graph; the
    result says the seconds of each part (setup_s: the CUDA context, stand-ins and replica;
    warm_s: the warm-up step with its compiles; record_s: the step graph and its check) and the
    size of inductor's worker pool it compiled with (the spec's share of the build's cores)."""
    import torch._inductor.config as inductor_config

    began = time.monotonic()
    stable_graph_cache_keys()  # the build's settings: part of the graphs' cache keys
    if spec.compile_threads is not None:  # before the first compile starts inductor's worker pool
        inductor_config.compile_threads = spec.compile_threads
    device = torch.device(spec.device)
    if device.type == "cuda":
        # anything that asks for the current device gets this one, not a context on cuda:0
        torch.cuda.set_device(device)
        if spec.memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, device)
    drafter = DrafterConfig(**{**spec.drafter, "target_layer_ids": tuple(spec.drafter["target_layer_ids"])})
    shape, plan = ShapeConfig(**spec.shape), StepPlan(**spec.plan)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator(device).manual_seed(WARMUP_SEED)
    vocab, hidden = drafter.vocab_size, drafter.hidden_size
    embed = torch.randn(vocab, hidden, generator=gen, device=device).to(dtype)
    head = FrozenHead(embed, torch.randn(vocab, hidden, generator=gen, device=device).to(dtype))
    features = torch.randn(*spec.features, generator=gen, device=device).to(dtype)
    if plan.compiled:
        raise_recompile_limit(spec.drafter_devices)
    step = ReplicaStep(spec.gamma, spec.chunk_size, teacher=spec.teacher)
    rep = DrafterReplica(spec.replica_index, drafter, device, head, plan, step)
    reset_weights([rep], WARMUP_SEED)
    batch = synthetic_micro_batch(shape, vocab, spec.pad_token_id)
    check = synthetic_micro_batch(shape, vocab, spec.pad_token_id, seed=WARMUP_SEED + 1)
    before, set_up = compile_snapshot(), time.monotonic()
    warm_replica(rep, batch, features)
    warmed = time.monotonic()
    graph = plan.compiled and record_step_graph(rep, batch, features, check)
    seconds = {"setup_s": set_up - began, "warm_s": warmed - set_up, "record_s": time.monotonic() - warmed}
    return {
        "ok": True,
        "step_graph": bool(graph),
        "compile_threads": inductor_config.compile_threads,
        **{k: round(v, 2) for k, v in seconds.items()},
        **compile_delta(before, compile_snapshot()),
    }


def exit_with_parent(parent: int) -> None:
    """A child whose build died (SIGKILL leaves no one to stop it) stops compiling for no one:
    once its parent is no longer `parent` (the build's pid, given on the command line, since the
    build may die while this process still imports), it exits within a second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="side-compile-parent", daemon=True).start()


def prepare() -> None:
    """While the build still imports transformers: the imports the compile would otherwise start
    with (the drafter's RoPE is transformers' Qwen3 one, so its modeling module too). The CUDA
    context waits for the spec: the build creates its own first (a GPU in exclusive-process mode
    takes one process only)."""
    from ..libraries import collector_paused
    from ..transformers_imports import skip_unused_imports

    with collector_paused():  # libraries.py says why
        import torch._dynamo
        import torch._inductor.compile_fx  # noqa: F401

        skip_unused_imports()
        import transformers.models.qwen3.modeling_qwen3  # noqa: F401


def main() -> int:
    exit_with_parent(int(sys.argv[1]))
    prepare()
    line = sys.stdin.readline()  # until the build sends the spec (or stops this process)
    try:
        fields = json.loads(line)
    except ValueError:  # the build closed the pipe without one: nothing to compile
        return 0
    spec = SideSpec(**{**fields, "features": tuple(fields["features"])})
    try:
        result = run_child(spec)
    except Exception as e:  # noqa: BLE001 - reported to the build, which compiles for itself
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1000]}"}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    # at once: the compile cache is written, and the interpreter's shutdown would wait on
    # inductor's worker pool while the build waits on this process (the build ends the pool)
    sys.stdout.flush()
    os._exit(code)
