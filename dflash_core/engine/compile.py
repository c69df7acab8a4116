"""Everything the engine does around torch.compile: the cache directory, inductor's worker pool,
the recompile limit, the post-warm-up guard, and the accounting of where compile time went.

torch.compile is not thread-safe, and past its recompile limit it silently falls back to eager
(for flex_attention: the unfused O(S^2) path). The engine therefore compiles everything during
warm-up, in one thread, and afterwards treats any compile as a bug: `CompileGuard` counts
compiled graphs by phase and switches dynamo to `fail_on_recompile`, which turns a new compile in
any thread into a RuntimeError instead of a silent recompile.

Several helpers here read private torch APIs (inductor's pool, dynamo's timers). A torch without
them loses a head start or a log line, never the build.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ..trust import problem, tree_problem

log = logging.getLogger("dflash.engine")
_SET_HERE: dict[str, str] = {}  # cache variables this process set itself (not exported by the user)
TRITON_KERNELS_DIR = "triton-kernels"  # Triton's own cache, under the inductor cache directory


def use_cache_dir(directory: str, why: str) -> tuple[str, str]:
    """Point the compile caches under `directory` unless the user exported their variables:
    inductor's (TORCHINDUCTOR_CACHE_DIR: compiled graphs and their Triton kernels) and Triton's own
    (TRITON_CACHE_DIR: the engine's hand-written Triton kernels). The directories in effect; the
    log says which and why, since a warm start depends on them.

    Must run before anything imports torch._dynamo, which fixes TORCHINDUCTOR_CACHE_DIR to a
    per-user temporary directory when it is unset."""
    out = []
    for var, path in (
        ("TORCHINDUCTOR_CACHE_DIR", directory),
        ("TRITON_CACHE_DIR", os.path.join(directory, TRITON_KERNELS_DIR)),
    ):
        if var not in os.environ:
            os.environ[var] = _SET_HERE[var] = path
            reason = why
        elif _SET_HERE.get(var) == os.environ[var]:
            reason = "set by an earlier engine of this process"
        else:
            reason = f"{var} is exported"
        used = os.environ[var]
        log.info("compile cache %s: %s (%s)", var, used, reason, extra={"fields": {"variable": var, "directory": used}})
        out.append(used)
    return out[0], out[1]


ARTIFACTS_FILE = "compile-artifacts.bin"


def save_artifacts(path: Path) -> int:
    """torch's portable compile artifacts of everything this process compiled (cache entries that
    another machine's caches can be filled with), written atomically to `path`; their size in
    bytes, 0 where nothing was compiled or torch cannot save them."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        return 0
    saved = save()
    if saved is None:
        return 0
    data = saved[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def load_artifacts(path: Path) -> bool:
    """Fill the compile caches from artifacts saved by `precompile` (before anything compiles);
    whether they were loaded. Unreadable artifacts (another torch version, say) are skipped with a
    warning: the build then compiles as usual."""
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not path.is_file():
        return False
    try:
        info = load(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - a stale artifact file must not stop the daemon
        info, why = None, str(e)
    else:
        why = "torch could not read them"
    if info is None:
        log.warning("compile artifacts %s not loaded (%s); compiling as usual", path, why)
        return False
    log.info("compile artifacts loaded from %s", path)
    return True


def trusted_artifacts(path: Path, data_dir: Path) -> bool:
    """Whether the compile artifacts at `path` may be loaded (they hold code the process runs):
    owned by the daemon's user and writable by no other (dflash_core.trust); logs why not."""
    why = problem(path, data_dir)
    if why is not None:
        log.error("compile artifacts refused: %s (see the README's trust boundary); compiling as usual", why)
    return why is None


def trusted_cache_dir(directory: Path, data_dir: Path) -> tuple[str, str]:
    """(the compile cache directory to use, why) for the data directory's default: a private
    temporary directory instead where the default's tree fails the trust check (its kernels are
    loaded and run), so the daemon starts cold rather than running what another user put there."""
    exported = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if exported is not None and _SET_HERE.get("TORCHINDUCTOR_CACHE_DIR") != exported:
        return str(directory), "the data directory's default"  # not used: the exported one wins
    why = tree_problem(directory, data_dir)
    if why is None:
        return str(directory), "the data directory's default"
    log.error("compile cache refused: %s (see the README's trust boundary); compiling into a temporary one", why)
    return tempfile.mkdtemp(prefix="dflash-inductor-"), f"the default was refused: {why}"


def start_compile_workers() -> bool:
    """Ask inductor to start its Triton worker pool now; whether a pool now exists.

    Torch starts the pool only at the first compile and builds every kernel in this process until
    a worker answers; started at the beginning of the build, the pool is ready while the target
    loads, so the drafters' kernels build in parallel. False where torch uses no pool
    (TORCHINDUCTOR_COMPILE_THREADS=1, TORCH_WARM_POOL=0, no Triton), has no such call, or the
    start failed."""
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


def raise_recompile_limit(devices: int) -> None:
    """Each drafter device is its own compiled entry (guards include the device index), so the
    limit grows with the devices; and hitting it is an error here rather than dynamo's silent
    eager run of the frame, which would leave the step ungraphed and the drafter threads tracing
    flex_attention eagerly together at the first job. Set in the thread that compiles (dynamo's
    config is per thread in newer torch)."""
    import torch._dynamo.config as dynamo_config

    need = 8 * max(1, devices)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < need:
            setattr(dynamo_config, name, need)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit") and not dynamo_config.suppress_errors:
        dynamo_config.fail_on_recompile_limit_hit = True


def stable_graph_cache_keys() -> None:
    """Make inductor's graph cache keys independent of what the process imported before torch.

    The FX graph cache key pickles each example input's metadata, its memory format too, which
    pickles as the global `torch.contiguous_format`: pickle finds a module for that dotted name
    by walking sys.modules for the first module with a `torch` attribute, and which one comes
    first depends on the process (`serve` imports the web stack before torch, `precompile` does
    not; `multiprocessing` aliases `__main__` as `__mp_main__`). The same graph then had two keys,
    and the first `serve` after `precompile` rebuilt every graph. Pickled by its bare name
    (`contiguous_format`), the format's module is `torch` itself, the first module that has one;
    it unpickles to the same object."""
    import copyreg

    copyreg.pickle(torch.memory_format, _memory_format_by_name)


def _memory_format_by_name(fmt: torch.memory_format) -> str:
    return str(fmt).removeprefix("torch.")


def compiled_graphs() -> int:
    """The graphs dynamo compiled in this process so far: 0 before anything imported dynamo (then
    nothing has been compiled, and importing it here would move a second of a start's imports
    in front of what the start does first)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - dynamo unavailable: nothing is ever compiled
        return 0
    return int(counters["stats"]["unique_graphs"])


class CompileGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = compiled_graphs()
        self._warm_end: int | None = None
        self._enforcing = False

    def end_warmup(self, enforce: bool) -> None:
        with self._lock:
            self._warm_end = compiled_graphs()
        if enforce and hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("fail_on_recompile")
            self._enforcing = True

    def release(self) -> None:
        """Back to dynamo's default stance (the stance is process-wide; the engine is closing)."""
        if self._enforcing:
            torch.compiler.set_stance("default")
            self._enforcing = False

    def counts(self) -> dict[str, int]:
        now = compiled_graphs()
        with self._lock:
            if self._warm_end is None:
                return {"warmup": now - self._start, "runtime": 0}
            return {"warmup": self._warm_end - self._start, "runtime": now - self._warm_end}


# dynamo's per-phase timers (seconds, summed) worth a log line per GPU
_PHASES = {
    "dynamo_s": "_compile.compile_inner",
    "triton_in_process_s": "async_compile.precompile",  # kernels built here: the pool was not ready
    "triton_pool_wait_s": "async_compile.wait",
    "load_modules_s": "PyCodeCache.load_by_key_path",
    "backward_s": "compile_fx.<locals>.bw_compiler",
    "autotune_s": "CachingAutotuner.benchmark_all_configs",
}
_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "async_compile_cache_hit", "async_compile_cache_miss")
# AOTAutograd's: a warm start that bypasses or misses it traces the joint graphs again
_AOT_COUNTERS = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")


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
    for name in _AOT_COUNTERS:
        out[name.replace("autograd_cache", "aot_cache")] = float(counters["aot_autograd"][name])
    return out


def compile_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before, rounded for a log line."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in after}


def log_compile_times() -> None:
    """Where a cold start's time went, per compiled function and phase (dynamo's accounting)."""
    try:
        from torch._dynamo.utils import compile_times

        log.info(
            "compile times (dynamo, seconds per function and phase):\n%s", compile_times(repr="str", aggregate=True)
        )
    except Exception as e:  # noqa: BLE001 - diagnostics only
        log.debug("no compile times: %s", e)
