"""Shared pieces of the GPU benchmarks: reference shapes, target config dirs, timing, peak rate."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.tables import out_dir, print_table
from dflash_core.config import DrafterConfig, ShapeConfig


def dims(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """A transformer's sizes under their Hugging Face config names, in the order configs list them."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    **dims(4096, 12288, 36, 32, 8, 128),
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    torch_dtype="bfloat16",
)
REFERENCE_SHAPE = ShapeConfig(seq_len=3072, num_anchors=512, block_size=16)


def reference_drafter_config(layers: int = 5, mask_token_id: int = 5) -> DrafterConfig:
    return DrafterConfig(
        **dims(4096, 12288, layers, 32, 8, 128),
        vocab_size=151936,
        block_size=16,
        mask_token_id=mask_token_id,
        target_layer_ids=(1, 9, 17, 25, 33),
        num_target_layers=36,
        rope_theta=1_000_000.0,
    )


def write_target_dir(out: Path, preset: dict = QWEN3_8B, **overrides) -> Path:
    """A target directory (config.json + the embedded default tokenizer) for random-init targets."""
    from dflash_core.defaults import ASSETS

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(preset, **overrides), indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = ASSETS / "target" / f
        if src.exists():
            (out / f).write_bytes(src.read_bytes())
    return out


def random_target_engine_config(target: Path, drafters: list[str], seq_len: int, num_anchors: int, **extra):
    """An EngineConfig for the random-init target in `target` on cuda:0, blocks of 16."""
    from dflash_core.engine import EngineConfig

    return EngineConfig(
        target_path=str(target),
        target_random_init=True,
        target_devices=["cuda:0"],
        drafter_devices=drafters,
        seq_len=seq_len,
        num_anchors=num_anchors,
        block_size=16,
        **extra,
    )


def cuda_time_ms(fn, warmup: int = 3, iters: int = 20) -> list[float]:
    """Per-iteration milliseconds measured with CUDA events (after warmup)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def timing_fields(times: list[float]) -> dict[str, float]:
    """A benchmark row's timing and CUDA memory columns: median and min of `times` (ms), the
    allocator's peak reserved since the last reset and what it holds now (GiB)."""
    return {
        "median_ms": round(median(times), 2),
        "min_ms": round(min(times), 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "steady_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def measured_bf16_peak_tflops(n: int = 8192) -> float:
    """Dense bf16 matmul rate on random data (the MFU denominator)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median(cuda_time_ms(lambda: a @ b, warmup=5, iters=20))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def drafter_flops(cfg: DrafterConfig, shape: ShapeConfig, visible_pairs: int) -> dict[str, float]:
    """Model FLOPs of one forward+backward, counted as docs/design.md (performance model) says."""
    h, kvd = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    qd = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * qd + 2 * h * kvd + qd * h + 3 * h * cfg.intermediate_size
    q = shape.num_query_tokens
    out = {
        "block_linears": 6 * per_layer * cfg.num_hidden_layers * q,
        "context": 6 * (cfg.num_target_features * h * h + 2 * h * kvd * cfg.num_hidden_layers) * shape.seq_len,
        "lm_head": 4 * cfg.vocab_size * h * q,
        "attention": 3.5 * 4 * cfg.num_attention_heads * cfg.head_dim * visible_pairs * cfg.num_hidden_layers,
    }
    out["total"] = sum(out.values())
    return out


def env_record() -> dict:
    import triton

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", "?"),
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
    }


def report(name: str, record: dict, title: str, rows: list[dict], cols: list[str]) -> None:
    """$OUT/<name>.json, then a title line and the table: the last thing a benchmark prints."""
    (out_dir() / f"{name}.json").write_text(json.dumps(record, indent=1))
    print("\n" + title)
    print_table(rows, cols)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def add_shape_arguments(parser) -> None:
    """--seq-len and --anchors, defaulting to the reference shape."""
    parser.add_argument("--seq-len", type=int, default=REFERENCE_SHAPE.seq_len)
    parser.add_argument("--anchors", type=int, default=REFERENCE_SHAPE.num_anchors)


def add_warm_arguments(parser, what: str) -> None:
    """--warm-jobs and --warm-budget: compile `what` in parallel processes first (cold machines)."""
    parser.add_argument(
        "--warm-jobs",
        type=int,
        default=0,
        help=f"first compile the {what} in this many parallel processes (cold machines)",
    )
    parser.add_argument("--warm-budget", type=float, default=300.0, help="seconds for that phase")


def warm_caches_in_parallel(
    module: str, names: list[str], args: list[str], jobs: int, budget_s: float
) -> dict[str, str]:
    """Compile every case in its own process, `jobs` at a time, so the cold compile of many
    kernels (minutes each on a fresh machine, mostly one single-threaded ptxas per kernel) shares
    the cores; the timed run in this process then loads them from the inductor and Triton caches.
    Each child runs `python -m <module> --cases NAME --compile-only <args>`. Returns the outcome
    per case: "ok", "failed rc=N" or "killed" (over the budget)."""
    if budget_s <= 0 or jobs <= 0:
        return {}
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    pending, running, outcome = list(names), {}, {}
    start = time.monotonic()
    log_dir = out_dir() / "compile_logs"
    log_dir.mkdir(exist_ok=True)
    while pending or running:
        over = time.monotonic() - start >= budget_s
        while pending and over:  # never start a compile the budget cannot hold
            name = pending.pop(0)
            outcome[name] = "killed"
            print(f"[warm {time.monotonic() - start:6.1f}s] {name}: not started, budget spent", flush=True)
        while pending and len(running) < jobs:
            name = pending.pop(0)
            log = open(log_dir / f"{name}.log", "w")
            # its own process group: a kill also stops the compiler processes it started
            running[name] = (
                subprocess.Popen(
                    [sys.executable, "-m", module, "--cases", name, "--compile-only", *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                outcome[name] = "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}"
            elif over:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                outcome[name] = "killed"
            else:
                continue
            log.close()
            del running[name]
            print(f"[warm {time.monotonic() - start:6.1f}s] {name}: {outcome[name]}", flush=True)
        time.sleep(0.5)
    return outcome
