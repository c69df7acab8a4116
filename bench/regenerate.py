"""Regeneration throughput on one GPU against the memory-bandwidth bound of the decode step.

A Qwen3-8B-shaped target with random weights (bf16) on cuda:0 decodes 512-token random prompts
for 512 new tokens each, end-of-sequence ignored, with the regeneration job's decoder
(dflash_core.regenerate.decode.SlotDecoder: static cache, continuous batching, the decode step
recorded as a CUDA graph). Per slot count:

  decode_ms      one decode step (graph replay), median after warm-up
  decode_tok_s   slots / decode_ms
  bound_tok_s    slots / (bytes the step reads / measured copy bandwidth); the step reads every
                 weight but the input embedding (one row per slot) and the whole static cache
                 (attention reads masked positions too)
  of_bound       decode_tok_s / bound_tok_s
  e2e_tok_s      generated tokens / wall time of the whole run (prefills, host work included)

    python -m bench.regenerate [--slots 128,256,512] [--prompt-len 512] [--new-tokens 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.common import QWEN3_8B, cuda_time_ms, env_record, median, out_dir, report, write_target_dir
from dflash_core.regenerate.decode import (
    Request,
    Sampling,
    SlotDecoder,
    kv_bytes_per_token,
    slots_for_memory,
    weight_bytes,
)
from dflash_core.target import TargetModel


def copy_bandwidth(gib: int = 4) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of 20."""
    x = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median(cuda_time_ms(lambda: y.copy_(x), warmup=3, iters=20))
    return 2 * (gib << 30) / (ms * 1e-3)


@torch.no_grad()
def run_slots(
    model, slots: int, prompt_len: int, new_tokens: int, bandwidth: float, vocab: int, use_graph: bool = True
) -> dict:
    length = prompt_len + new_tokens
    dec = SlotDecoder(model, slots, length, use_graph=use_graph)
    gen = torch.Generator().manual_seed(slots)
    prompts = torch.randint(10, vocab, (slots, prompt_len), generator=gen).tolist()
    requests = [Request(i, p, new_tokens, seed=i) for i, p in enumerate(prompts)]
    greedy = Sampling(ignore_stop=True)
    list(dec.generate([Request(-1, prompts[0], 4)], greedy))  # records the graph; the step's buffers settle
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    t = time.perf_counter()
    done = list(dec.generate(requests, greedy))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    reserved_after = torch.cuda.memory_reserved()
    generated = sum(len(c.tokens) for c in done)
    assert generated == slots * new_tokens, generated
    # a second wave: the first one's prefills settled the allocator, so this one must not grow it
    list(dec.generate([Request(i, p, new_tokens, seed=i) for i, p in enumerate(prompts)], greedy))
    torch.cuda.synchronize()
    creep = torch.cuda.memory_reserved() - reserved_after
    decode_ms = median(cuda_time_ms(lambda: dec._step(True), warmup=5, iters=30))
    sampled = Sampling(temperature=0.7, top_p=0.8, ignore_stop=True)
    dec.warm(sampled)
    sampled_ms = median(cuda_time_ms(lambda: dec._step(False), warmup=5, iters=30))
    emb = model.get_input_embeddings().weight
    weights = weight_bytes(model) - emb.numel() * emb.element_size()
    kv_full = slots * length * kv_bytes_per_token(model.config, dec.dtype)
    kv_valid = slots * (prompt_len + new_tokens // 2) * kv_bytes_per_token(model.config, dec.dtype)
    bound = slots / ((weights + kv_full) / bandwidth)
    bound_valid = slots / ((weights + kv_valid) / bandwidth)
    row = {
        "slots": slots,
        "graph": dec.use_graph,
        "kv_cache_gib": round(dec.cache.nbytes / 2**30, 2),
        "decode_ms": round(decode_ms, 3),
        "sampled_ms": round(sampled_ms, 3),
        "decode_tok_s": round(slots / (decode_ms * 1e-3)),
        "bound_tok_s": round(bound),
        "of_bound": round(slots / (decode_ms * 1e-3) / bound, 3),
        "bound_valid_kv_tok_s": round(bound_valid),
        "e2e_tok_s": round(generated / wall),
        "e2e_s": round(wall, 2),
        "reserved_first_wave_mib": round((reserved_after - reserved_before) / 2**20, 1),
        "reserved_second_wave_mib": round(creep / 2**20, 1),
    }
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", default="128,256,512")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    args = p.parse_args(argv)
    out_dir()
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    t = time.perf_counter()
    target_dir = write_target_dir(Path(tempfile.mkdtemp()) / "target", QWEN3_8B)
    target = TargetModel(target_dir, [1], "cuda:0", random_init=True)
    print(f"target built in {time.perf_counter() - t:.1f} s", flush=True)
    free, _ = torch.cuda.mem_get_info()
    per_token = kv_bytes_per_token(target.config, target.dtype)
    derived = slots_for_memory(free, per_token, args.prompt_len + args.new_tokens)
    print(f"free {free / 2**30:.1f} GiB after the target: the daemon's default would be {derived} slots", flush=True)
    rows = []
    vocab = int(target.config.vocab_size)
    for slots in (int(s) for s in args.slots.split(",")):
        try:
            rows.append(run_slots(target.model, slots, args.prompt_len, args.new_tokens, bandwidth, vocab))
        except Exception:  # noqa: BLE001 - the eager step still measures what the graph failed to
            traceback.print_exc()
            torch.cuda.empty_cache()
            rows.append(run_slots(target.model, slots, args.prompt_len, args.new_tokens, bandwidth, vocab, False))
        torch.cuda.empty_cache()  # the decoder of this slot count is gone: its cache goes back
        print(rows[-1], flush=True)
    report(
        "regenerate",
        {"env": env_record(), "copy_bandwidth_bytes_per_s": bandwidth, "args": vars(args), "rows": rows},
        f"regeneration decode, Qwen3-8B shape (random bf16), prompts {args.prompt_len} + {args.new_tokens} new tokens, "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s",
        rows,
        list(rows[0]),
    )


if __name__ == "__main__":
    main()
