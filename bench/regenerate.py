"""Regeneration throughput on one GPU against the memory-bandwidth bound of the decode step, and
against transformers' own static-cache `generate` in the same run.

A Qwen3-8B-shaped target with random weights on cuda:0, in each of `--precisions` (bf16; fp8:
the decoder linears as FP8 GEMMs, TargetModel(fp8=True), the embedding and LM head in bf16),
decodes 512-token random prompts for 512 new tokens each, end-of-sequence ignored, greedy, with
the regeneration job's decoder (dflash_core.regenerate.decode.SlotDecoder: static cache,
continuous batching, the decode step recorded as a CUDA graph), its attention as each of
`--kernel` says: on, the Triton kernel that reads each slot's valid cache positions only
(kernels/decode_attention.py); on:BN/W/S, the kernel with these launch settings in place of its
defaults (block_n, num_warps, num_stages: a same-run comparison of settings); off, the masked
batched GEMMs over the whole static cache. `--fused` says how the layers' elementwise work runs:
on, the decoder's default on CUDA (its RMSNorms, rotary embeddings and decode-step cache writes
as Triton kernels: target_norms.py, target_rope.py, kernels/slot_write.py; a sampled step's
noise and argmax, kernels/gumbel_max.py; the query, key and value projections as one GEMM,
target_qkv.py); eager-sampler, all of that but the sampling, which runs as torch ops; three-gemms,
all of it but the q/k/v projections, three GEMMs as transformers runs them; norms, the RMSNorm
kernel alone (the rotary embedding, the cache writes, the projections and the sampling as
transformers runs them); off, transformers' eager code and the sampling as torch ops;
on,norms,off: a row of each.

`--waves N` decodes N times as many requests as there are slots (the prompts repeated), the
slots refilled as they free: end to end and the prefills' time over the N waves.
`--ride R` (comma-separated, a row each) lets the freed slots' prompts ride in the decode steps,
up to R prompt tokens a step (chunked prefill, regenerate/ride.py; 0: every prompt prefilled
whole; default, the default: the decoder's own count, twice the slots up to 512 with the
kernel), each step at the narrowest of the decoder's widths that holds its tokens; R:widest rides
every step at R rows (one width, as the decoder did before it had several).

`--new-tokens-spread F` gives each request its own count of new tokens, drawn evenly from
new-tokens x (1 - F) to new-tokens x (1 + F) (the same mean), so that sequences end apart, as
stop tokens and differing lengths make them in a real job, and prompts are prefilled while other
slots decode; the cache then holds the longest, and the step timings and bounds stay at
prompt + new-tokens. `--prompt-len-spread F` does the same for the prompts' lengths (with
`--hf-batch 0`): long prompts wait for a prefill where short ones ride, as in a real dataset; the
timings and bounds then take the mean prompt (`prompt_len`), the cache the longest.

A row per precision, attention and slot count:

  record_s       the decoder's start: the greedy step recorded at each riding width and without
                 riding rows, then a 4-token generate (what a regeneration job pays before its
                 first prompt, once per sampling mode)
  full_ms        one decode step (graph replay) with every slot at the last position a sequence
                 feeds (the cache's last but one: the last is where idle slots park), median after
                 warm-up: the step that reads the whole cache with either attention
  decode_ms      the same with the slots at the run's mean position (prompt + half the new
                 tokens): what a wave's steps take on average
  sampled_ms     decode_ms with sampling (temperature 0.7, top-p 0.8: each row cut at its floor,
                 kernels/top_p.py; every row sorted where the sampling runs as torch ops)
  sampled_topk_ms  decode_ms with sampling (temperature 0.7, top-p 0.8, top-k 20, Qwen3's suggested
                 non-thinking setting: each row's 20 largest picked, no sort)
  sampled_all_ms decode_ms with sampling from the whole distribution (temperature 1, no top-k
                 or top-p: the on-policy setting)
  decode_tok_s   slots / decode_ms
  bound_tok_s    slots / (bytes / measured copy bandwidth), the bytes being every weight the
                 step reads (all but the input embedding; FP8 weights count one byte) and the
                 whole static cache: the bound of an attention that reads masked positions too
  of_bound       (slots / full_ms) / bound_tok_s: the step at the cache's end against the bytes
                 it must then read, the same for both attentions
  bound_valid_kv_tok_s  as bound_tok_s with only the cache positions a step must read, averaged
                 over the run (prompt + half the new tokens per slot): the bound of the step
  of_valid_bound decode_tok_s / bound_valid_kv_tok_s: the mean step against the bytes it must
                 read; the masked attention reads more than that, so its figure is lower
  floor_ms       the step at the cache's end if the whole cache were read at the copy bandwidth
                 and the GEMMs ran at the measured matmul rate (each at least its weight bytes
                 at the bandwidth), one after the other: a layer's attention needs its
                 projections and feeds the next, so at slot counts where the GEMMs are compute
                 bound this, not bound_tok_s, is the step's physical floor without overlapping
                 slots across streams
  of_floor       floor_ms / full_ms
  e2e_tok_s      generated tokens / wall time of the whole run of `--waves` waves (prefills, host
                 work included)
  prefill_s      the run's time in prefills (SlotDecoder.prefill_seconds: every prompt, in
                 chunks, host work included)
  ride_widths    the riding step's widths (rows), widest first
  steps, steps_riding  the run's decode steps, and those of them that carried riding rows
  steps_by_width the riding steps per width, width:steps
  ride_ms        a step with every riding row of the widest width filled (prompts of the bench's
                 width from their first token), the slots at the mean position: decode_ms plus
                 what the rows cost
  ride_ms_by_width  the same at each width, width:ms
  prefill_ideal_s  the run's prefills' matmul FLOPs at the measured dense bf16 matmul rate (twice it
                 for fp8: Hopper's FP8 tensor-core rate): 2 * the decoder layers' weights * the
                 prompt tokens (the embedding is a lookup and the LM head runs at each prompt's
                 last token only; the attention's own FLOPs are left out: about 1 % more at
                 512-token prompts of this shape)

and a row per precision for transformers' `model.generate(..., cache_implementation="static")`
on the same prompts (the first `--hf-batch` of them; its attention is SDPA over the whole static
cache under a mask), greedy, warmed first, torch.compile off (`disable_compile`): e2e_tok_s over
the whole call, and decode_ms as the time past the first token per step ((wall of the whole call
- wall of a call for one token) / (new tokens - 1)), against the bound of its cache.

    python -m bench.regenerate [--slots 128,256,512] [--precisions bf16,fp8] [--kernel on,off]
        [--fused on,eager-sampler,three-gemms,norms,off] [--hf-batch 128]
        [--prompt-len 512] [--new-tokens 512] [--waves 1] [--new-tokens-spread 0] [--ride default]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import tempfile
import time
import traceback
from pathlib import Path

import torch

import dflash_core.kernels.decode_attention as dak
from bench.common import (
    QWEN3_8B,
    cuda_time_ms,
    env_record,
    measured_bf16_peak_tflops,
    median,
    out_dir,
    report,
    write_target_dir,
)
from bench.tables import columns_of
from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder
from dflash_core.regenerate.sizing import decoder_bytes, kv_bytes_per_token, slots_for_memory, weight_bytes
from dflash_core.target import TargetModel

WARMUP, ITERS = 5, 30  # graph replays before and in a timing


def copy_bandwidth(gib: int = 4) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of 20."""
    x = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median(cuda_time_ms(lambda: y.copy_(x), warmup=3, iters=20))
    return 2 * (gib << 30) / (ms * 1e-3)


def step_weight_bytes(model) -> int:
    """The weight bytes a decode step reads: every parameter and buffer (an FP8 linear keeps its
    weight as a buffer) but the input embedding, of which a step reads one row per slot (unless
    the LM head is the same table, which the step reads whole)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    return weight_bytes(model) - (0 if tied else emb.numel() * emb.element_size())


def prefill_weights(model) -> int:
    """The weights each prompt token is multiplied by in a prefill: every parameter and buffer
    element of the decoder's layers (an FP8 linear keeps its weight as a buffer, one element per
    weight, and its scale)."""
    layers = model.get_decoder().layers
    return sum(t.numel() for t in (*layers.parameters(), *layers.buffers()))


def bound(slots: int, weights: int, positions: int, per_token: int, bandwidth: float) -> float:
    """Tokens per second of a step that reads `weights` and `positions` cache positions per slot
    at `bandwidth`."""
    return slots / ((weights + slots * positions * per_token) / bandwidth)


def serial_floor_ms(
    model, slots: int, cache_bytes: int, bandwidth: float, layer_flops: float, head_flops: float
) -> float:
    """The step at the cache's end with its attention reading the whole cache at `bandwidth` and its
    GEMMs (each at least its weight bytes at `bandwidth`) at the measured rates, one after the
    other as a layer's dependencies order them (ms)."""
    head = model.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    layer_bytes = step_weight_bytes(model) - head_bytes
    layers = max(layer_bytes / bandwidth, 2 * slots * prefill_weights(model) / layer_flops)
    lm_head = max(head_bytes / bandwidth, 2 * slots * head.numel() / head_flops)
    return (slots * cache_bytes / bandwidth + layers + lm_head) * 1e3


def new_token_counts(requests: int, new_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """Each request's count of new tokens: new_tokens for every one (spread 0), else drawn evenly
    from the integers within new_tokens x (1 +- spread) (their mean new_tokens), at least 1."""
    if not 0 <= spread < 1:
        raise ValueError(f"a spread of new tokens is in [0, 1), not {spread}")
    if spread == 0:
        return [new_tokens] * requests
    lo, hi = max(1, round(new_tokens * (1 - spread))), round(new_tokens * (1 + spread))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (requests,), generator=gen).tolist()


def time_step(dec: SlotDecoder, mode: str, position: int, ride: int = 0, prompt_len: int = 1) -> float:
    """Median ms of the decode step with every slot at `position`: the timed steps start early
    enough to centre on it (each step moves the slots on by one; the last position a sequence
    feeds holds them). ride: the step at this riding width, every row filled as prompts of
    prompt_len tokens riding from their first token fill them (they write into the first slots'
    caches, which no later timing reads as a sequence's)."""
    last = dec.length - 2
    dec.positions.fill_(last if position >= last else max(0, position - WARMUP - ITERS // 2))
    if ride:
        rows = torch.arange(ride, device=dec.device)
        dec.ride[:, :ride] = torch.stack((rows % 1000 + 10, (rows // prompt_len) % dec.slots, rows % prompt_len))
    return median(cuda_time_ms(lambda: dec._replay(mode, ride), warmup=WARMUP, iters=ITERS))


@torch.no_grad()
def run_slots(
    model,
    slots: int,
    prompts: list[list[int]],
    new_tokens: int,
    bandwidth: float,
    matmul_flops: float,
    kernel: bool,
    fused: str = "on",
    use_graph=True,
    head_flops: float | None = None,
    waves: int = 1,
    spread: float = 0.0,
    ride_rows: int | None = None,
    ride_widest: bool = False,
) -> dict:
    """A row of the decoder at `slots` (matmul_flops: the decoder layers' dense matmul rate,
    head_flops the LM head's, FLOP/s; the same unless given; spread: new_token_counts';
    ride_widest: every riding step at the widest width)."""
    wave = prompts[:slots]
    prompt_len = round(sum(map(len, wave)) / len(wave))  # the mean, where prompts differ in length
    length = prompt_len + new_tokens  # what the step timings and the bounds count
    counts = new_token_counts(waves * len(wave), new_tokens, spread)
    cache_length = max(map(len, wave)) + max(counts)
    dec = SlotDecoder(
        model,
        slots,
        cache_length,
        use_graph=use_graph,
        attention_kernel=kernel,
        fused_kernels=fused != "off",
        ride_rows=ride_rows,
    )
    if fused == "norms":  # the decoder as it was before its rotary and cache-write kernels
        dec.rope = None
        dec.cache.write_kernel = False
    if fused in ("norms", "three-gemms"):  # the projections as three GEMMs, as before their stacking
        dec.qkv = None
    if fused in ("norms", "eager-sampler"):  # the sampling as torch ops, as before its kernels
        dec.sample_kernel = dec.floor_kernel = False
    if ride_widest:  # one riding width, as before the narrower ones
        dec.ride_widths = dec.ride_widths[:1]
    requests = [Request(i, wave[i % len(wave)], n, seed=i) for i, n in enumerate(counts)]
    greedy = Sampling(ignore_stop=True)
    # the start a regeneration job pays: the greedy step recorded at each riding width and plain,
    # then a short generate (the step's buffers settle)
    torch.cuda.synchronize()
    began = time.perf_counter()
    list(dec.generate([Request(-1, prompts[0], 4)], greedy))
    torch.cuda.synchronize()
    record_s = time.perf_counter() - began
    reserved_before = torch.cuda.memory_reserved()
    dec.prefill_seconds = 0.0
    dec.decode_steps = 0
    dec.width_steps.clear()
    t = time.perf_counter()
    done = list(dec.generate(requests, greedy))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    prefill_s = dec.prefill_seconds
    steps_run, steps_riding, width_steps = dec.decode_steps, dec.riding_steps, dict(dec.width_steps)
    reserved_after = torch.cuda.memory_reserved()
    generated = sum(len(c.tokens) for c in done)
    assert generated == sum(counts), generated
    # another wave: the timed run's prefills settled the allocator, so this one must not grow it
    # (reserved_first_wave_mib: what the timed run, all its waves, grew it by)
    list(dec.generate(requests[: len(wave)], greedy))
    torch.cuda.synchronize()
    creep = torch.cuda.memory_reserved() - reserved_after
    mean_valid = prompt_len + new_tokens // 2  # positions a step reads per slot, over the run
    full_ms = time_step(dec, "greedy", length - 1)
    decode_ms = time_step(dec, "greedy", mean_valid - 1)
    ride_ms = {w: time_step(dec, "greedy", mean_valid - 1, w, prompt_len) for w in dec.ride_widths}
    sampled = {}
    for name, sampling in (
        ("sampled_ms", Sampling(temperature=0.7, top_p=0.8, ignore_stop=True)),
        ("sampled_topk_ms", Sampling(temperature=0.7, top_p=0.8, top_k=20, ignore_stop=True)),
        ("sampled_all_ms", Sampling(temperature=1.0, ignore_stop=True)),
    ):
        dec.warm(sampling)
        sampled[name] = round(time_step(dec, sampling.mode, mean_valid - 1), 3)
    weights = step_weight_bytes(model)
    per_token = kv_bytes_per_token(model.config, dec.dtype)
    whole = bound(slots, weights, length, per_token, bandwidth)
    valid = bound(slots, weights, mean_valid, per_token, bandwidth)
    decode_tok_s = slots / (decode_ms * 1e-3)
    floor_ms = serial_floor_ms(model, slots, length * per_token, bandwidth, matmul_flops, head_flops or matmul_flops)
    return {
        "attention": "kernel" if dec.attention_kernel else "masked",
        "fused": fused_label(dec),
        "slots": slots,
        "ride_rows": dec.ride_rows,
        "ride_widths": "/".join(map(str, dec.ride_widths)),
        "waves": waves,
        "prompt_len": prompt_len,
        "prompt_len_max": max(map(len, wave)),
        "new_tokens_spread": spread,
        "graph": dec.use_graph,
        "record_s": round(record_s, 2),
        "kv_cache_gib": round(dec.cache.nbytes / 2**30, 2),
        "stacked_qkv_gib": round(dec.qkv.nbytes / 2**30, 2) if dec.qkv is not None else 0.0,
        "weights_gb": round(weights / 1e9, 2),
        "full_ms": round(full_ms, 3),
        "decode_ms": round(decode_ms, 3),
        **sampled,
        "decode_tok_s": round(decode_tok_s),
        "bound_tok_s": round(whole),
        "of_bound": round(slots / (full_ms * 1e-3) / whole, 3),
        "bound_valid_kv_tok_s": round(valid),
        "of_valid_bound": round(decode_tok_s / valid, 3),
        "floor_ms": round(floor_ms, 2),
        "of_floor": round(floor_ms / full_ms, 3),
        "e2e_tok_s": round(generated / wall),
        "e2e_s": round(wall, 2),
        "prefill_s": round(prefill_s, 2),
        "steps": steps_run,
        "steps_riding": steps_riding,
        "steps_by_width": " ".join(f"{w}:{width_steps.get(w, 0)}" for w in dec.ride_widths),
        "ride_ms": round(ride_ms[dec.ride_widths[0]], 3) if ride_ms else None,
        "ride_ms_by_width": " ".join(f"{w}:{ms:.2f}" for w, ms in ride_ms.items()),
        "prefill_ideal_s": round(2 * prefill_weights(model) * sum(len(r.prompt) for r in requests) / matmul_flops, 2),
        "reserved_first_wave_mib": round((reserved_after - reserved_before) / 2**20, 1),
        "reserved_second_wave_mib": round(creep / 2**20, 1),
    }


@torch.no_grad()
def run_generate(model, batch: int, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> dict:
    """transformers' greedy generate with its static cache over the first `batch` prompts."""
    ids = torch.tensor(prompts[:batch], device="cuda")
    kw = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,
        pad_token_id=0,
    )

    def call(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    call(4)  # warm: kernels chosen, allocator grown
    first, _ = call(1)
    wall, out = call(new_tokens)
    generated = (out.shape[1] - ids.shape[1]) * batch
    assert generated == batch * new_tokens, generated
    decode_ms = (wall - first) / max(1, new_tokens - 1) * 1e3
    weights = step_weight_bytes(model)
    length = ids.shape[1] + new_tokens
    whole = bound(batch, weights, length, kv_bytes_per_token(model.config, next(model.parameters()).dtype), bandwidth)
    return {
        "attention": "hf generate",
        "slots": batch,
        "graph": False,
        "weights_gb": round(weights / 1e9, 2),
        "decode_ms": round(decode_ms, 3),
        "decode_tok_s": round(batch / (decode_ms * 1e-3)),
        "bound_tok_s": round(whole),
        "of_bound": round(batch / (decode_ms * 1e-3) / whole, 3),
        "e2e_tok_s": round(generated / wall),
        "e2e_s": round(wall, 2),
    }


def build_target(precision: str) -> TargetModel:
    t = time.perf_counter()
    target_dir = write_target_dir(Path(tempfile.mkdtemp()) / "target", QWEN3_8B)
    target = TargetModel(target_dir, [1], "cuda:0", random_init=True, fp8=precision == "fp8")
    if precision == "fp8":
        from dflash_core.target_precision import Fp8FrozenLinear

        fp8 = sum(isinstance(m, Fp8FrozenLinear) for m in target.model.modules())
        head = target.model.get_output_embeddings().weight.dtype
        print(f"fp8 target: {fp8} FP8 linears, LM head {head}", flush=True)
        assert fp8 > 0 and head == torch.bfloat16
    print(f"{precision} target built in {time.perf_counter() - t:.1f} s", flush=True)
    return target


@contextlib.contextmanager
def kernel_settings(settings: tuple[int, int, int] | None):
    """The decode-attention kernel's launch defaults replaced while a row runs (None: kept)."""
    if settings is None:
        yield
        return
    saved = (dak.BLOCK_N, dak.NUM_WARPS, dak.NUM_STAGES)
    dak.BLOCK_N, dak.NUM_WARPS, dak.NUM_STAGES = settings
    try:
        yield
    finally:
        dak.BLOCK_N, dak.NUM_WARPS, dak.NUM_STAGES = saved


def parse_kernels(spec: str) -> list[tuple[bool, tuple[int, int, int] | None]]:
    """--kernel's rows: on, off, or on:BN/W/S."""
    out: list[tuple[bool, tuple[int, int, int] | None]] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name in ("on", "off"):
            out.append((name == "on", None))
            continue
        head, _, tail = name.partition(":")
        parts = tail.split("/")
        if head != "on" or len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"--kernel takes on, off or on:BLOCK_N/WARPS/STAGES, not {name!r}")
        out.append((True, (int(parts[0]), int(parts[1]), int(parts[2]))))
    if not out:
        raise ValueError("--kernel names no row")
    return out


FUSED_ROWS = ("on", "eager-sampler", "three-gemms", "norms", "off")


def parse_fused(spec: str) -> list[str]:
    """--fused's rows: on, eager-sampler, three-gemms, norms, off."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names or not set(names) <= set(FUSED_ROWS):
        raise ValueError(f"--fused takes {', '.join(FUSED_ROWS)}, not {spec!r}")
    return list(dict.fromkeys(names))


def parse_rides(spec: str) -> list[tuple[int | None, bool]]:
    """--ride's rows: (rows, or None for the decoder's default; whether every step rides at the widest width)."""
    rides = []
    for part in (p.strip() for p in spec.split(",")):
        rows, _, how = part.partition(":")
        if not (rows == "default" or rows.isdigit()) or how not in ("", "widest"):
            raise ValueError(
                f"--ride takes comma-separated counts of rows (0 for none), R:widest or default, not {part!r}"
            )
        rides.append((None if rows == "default" else int(rows), how == "widest"))
    return rides


def fused_label(dec) -> str:
    """Which of its kernels a decoder runs: norms, rope, writes, qkv, sampler joined by '+', or
    eager."""
    kernels = (
        ("norms", dec.norms),
        ("rope", dec.rope),
        ("writes", dec.cache.write_kernel),
        ("qkv", dec.qkv),
        ("sampler", dec.sample_kernel),
    )
    parts = [name for name, on in kernels if on]
    return "+".join(parts) or "eager"


def bench_precision(
    precision: str, args, kernels, fused_rows: list[str], bandwidth: float, bf16_flops: float
) -> list[dict]:
    """The rows of one target precision (the target is gone when this returns)."""
    target = build_target(precision)
    matmul_flops = bf16_flops * (2 if precision == "fp8" else 1)
    free, _ = torch.cuda.mem_get_info()
    per_token = kv_bytes_per_token(target.config, target.dtype)
    longest = round(args.prompt_len * (1 + args.prompt_len_spread)) + round(
        args.new_tokens * (1 + args.new_tokens_spread)
    )
    derived = slots_for_memory(free - decoder_bytes(target.model), per_token, longest)
    print(f"free {free / 2**30:.1f} GiB after the target: the daemon's default would be {derived} slots", flush=True)
    slot_counts = [int(s) for s in args.slots.split(",")]
    gen = torch.Generator().manual_seed(0)
    most = max([*slot_counts, args.hf_batch])
    lengths = new_token_counts(most, args.prompt_len, args.prompt_len_spread, seed=1)
    prompts = [torch.randint(10, int(target.config.vocab_size), (n,), generator=gen).tolist() for n in lengths]
    rows = []
    rides = parse_rides(args.ride)
    for slots, (kernel, settings), fused, (ride, widest) in itertools.product(slot_counts, kernels, fused_rows, rides):
        run = (target.model, slots, prompts, args.new_tokens, bandwidth, matmul_flops, kernel, fused)
        try:
            with kernel_settings(settings):
                row = run_slots(
                    *run,
                    head_flops=bf16_flops,
                    waves=args.waves,
                    spread=args.new_tokens_spread,
                    ride_rows=ride,
                    ride_widest=widest,
                )
        except Exception:  # noqa: BLE001 - the eager step still measures what the graph failed to
            traceback.print_exc()
            torch.cuda.empty_cache()
            try:
                with kernel_settings(settings):
                    row = run_slots(
                        *run,
                        use_graph=False,
                        head_flops=bf16_flops,
                        waves=args.waves,
                        spread=args.new_tokens_spread,
                        ride_rows=ride,
                        ride_widest=widest,
                    )
            except Exception as e:  # noqa: BLE001 - a row that says why; the other rows still come
                traceback.print_exc()
                row = {"attention": "kernel" if kernel else "masked", "fused": f"{fused} (asked)"}
                row.update(slots=slots, ride_rows=ride, error=type(e).__name__)
        if settings is not None:
            row["attention"] += " " + "/".join(map(str, settings))
        rows.append({"precision": precision, **row})
        torch.cuda.empty_cache()  # the decoder of this slot count is gone: its cache goes back
        print(rows[-1], flush=True)
    if args.hf_batch > 0:
        try:
            row = run_generate(target.model, args.hf_batch, prompts, args.new_tokens, bandwidth)
        except torch.cuda.OutOfMemoryError:
            traceback.print_exc()
            row = {"attention": "hf generate", "slots": args.hf_batch, "error": "OutOfMemoryError"}
        rows.append({"precision": precision, **row})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", default="128,256,512")
    p.add_argument("--precisions", default="bf16,fp8", help="comma-separated: bf16, fp8")
    p.add_argument(
        "--kernel",
        default="on,off",
        help="the decode attention rows, comma-separated: on (the kernel), on:BN/W/S (its launch settings), off",
    )
    p.add_argument(
        "--fused",
        default="on",
        help="the elementwise rows, comma-separated: on (norms, rotary, cache writes, sampling as kernels, "
        "q/k/v as one GEMM), eager-sampler (all but the sampling), three-gemms (all but the q/k/v GEMM), "
        "norms (that kernel alone), off (eager)",
    )
    p.add_argument("--waves", type=int, default=1, help="requests per slot (the prompts repeated)")
    p.add_argument("--hf-batch", type=int, default=128, help="transformers generate's batch (0: no such row)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument(
        "--prompt-len-spread",
        type=float,
        default=0.0,
        help="each prompt's length drawn evenly within prompt-len x (1 +- this), in [0, 1) (no generate row)",
    )
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument(
        "--new-tokens-spread",
        type=float,
        default=0.0,
        help="each request's new tokens drawn evenly within new-tokens x (1 +- this), in [0, 1): sequences end apart",
    )
    p.add_argument(
        "--ride",
        default="default",
        help="rows, comma-separated: prompt tokens a decode step carries at most beside its slots (chunked "
        "prefill, regenerate/ride.py); 0: prompts prefilled whole; default: the decoder's own choice; "
        "R:widest: every riding step at R rows",
    )
    args = p.parse_args(argv)
    try:
        parse_rides(args.ride)
    except ValueError as e:
        p.error(str(e))
    precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if not precisions or not set(precisions) <= {"bf16", "fp8"}:
        p.error("--precisions takes bf16 and fp8")
    if args.waves < 1:
        p.error("--waves takes a positive count")
    if not 0 <= args.new_tokens_spread < 1:
        p.error("--new-tokens-spread takes a fraction in [0, 1)")
    if not 0 <= args.prompt_len_spread < 1:
        p.error("--prompt-len-spread takes a fraction in [0, 1)")
    if args.prompt_len_spread and args.hf_batch:
        p.error("--prompt-len-spread needs --hf-batch 0: generate's row takes prompts of one length")
    try:
        kernels = parse_kernels(args.kernel)
        fused_rows = parse_fused(args.fused)
    except ValueError as e:
        p.error(str(e))
    out_dir()
    bandwidth = copy_bandwidth()
    bf16_flops = measured_bf16_peak_tflops() * 1e12
    torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul {bf16_flops / 1e12:.0f} TFLOP/s")
    rows = []
    for precision in precisions:
        rows += bench_precision(precision, args, kernels, fused_rows, bandwidth, bf16_flops)
        gc.collect()  # the target's forward hooks hold it in a reference cycle
        torch.cuda.empty_cache()
    report(
        "regenerate",
        {
            "env": env_record(),
            "copy_bandwidth_bytes_per_s": bandwidth,
            "bf16_matmul_flop_per_s": bf16_flops,
            "args": vars(args),
            "rows": rows,
        },
        f"regeneration decode, Qwen3-8B shape (random weights), prompts {args.prompt_len} + {args.new_tokens} new "
        f"tokens, copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {bf16_flops / 1e12:.0f} TFLOP/s",
        rows,
        columns_of(rows),
    )


if __name__ == "__main__":
    main()
