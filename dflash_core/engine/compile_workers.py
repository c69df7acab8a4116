"""Inductor's Triton compile workers, started early, and what each GPU's warm-up compiles cost.

Torch starts its compile worker pool only at the first compile, and until a worker has answered
it builds every Triton kernel in this process, one after another (measured on the H200, run Q:
33 s of a cold GPU's 51 s of compiles went to such in-process builds). Started at the beginning
of the engine build, the pool gets ready while the target loads, so the drafters' kernels build
in parallel. Both helpers touch private torch APIs: a torch without them only loses the head
start or the log line, never the build.
"""
from __future__ import annotations

import logging

log = logging.getLogger("dflash.engine")

# dynamo's per-phase timers (seconds, summed) worth a line per GPU
_PHASES = {
    "dynamo_s": "_compile.compile_inner",
    "triton_in_process_s": "async_compile.precompile",  # kernels built here: the pool was not ready
    "triton_pool_wait_s": "async_compile.wait",
    "load_modules_s": "PyCodeCache.load_by_key_path",
    "backward_s": "compile_fx.<locals>.bw_compiler",
    "autotune_s": "CachingAutotuner.benchmark_all_configs",
}
_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "async_compile_cache_hit", "async_compile_cache_miss")


def start_compile_workers() -> bool:
    """Ask inductor to start its worker pool now; whether a pool now exists. False where torch
    uses no pool (TORCHINDUCTOR_COMPILE_THREADS=1, TORCH_WARM_POOL=0, no Triton), has no such
    call (an older/newer torch) or the start failed."""
    try:
        from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
    except ImportError:
        return False
    try:
        maybe_warm_pool()
    except Exception as e:  # noqa: BLE001 - a head start only: torch starts it again at the first compile
        log.warning("could not start inductor's compile workers early: %s", e)
        return False
    try:  # maybe_warm_pool returns quietly where torch uses no pool; the pool is a cached factory
        return AsyncCompile.process_pool.cache_info().currsize > 0
    except AttributeError:  # a torch whose pool is not cached like that: the call above did not fail
        return True


def compile_workers_ready() -> bool:
    """Whether the next Triton kernel inductor builds goes to the worker pool."""
    try:
        from torch._inductor.async_compile import AsyncCompile

        return bool(AsyncCompile.use_process_pool())
    except Exception:  # noqa: BLE001 - diagnostics only
        return False


def compile_snapshot() -> dict[str, float]:
    """Cumulative compile seconds per phase and inductor's cache counters, as of now."""
    out: dict[str, float] = {}
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return out
    for key, phase in _PHASES.items():
        out[key] = float(sum(compilation_time_metrics.get(phase, ())))
    for name in _COUNTERS:
        out[name] = float(counters["inductor"][name])
    return out


def compile_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before, rounded for a log line."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
