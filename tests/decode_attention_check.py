"""The decode-attention kernels (dflash_core/kernels/decode_attention.py) against a float64
masked softmax, and the slot decoder with them against the decoder without them. Runs on CUDA
(tests/gpu) and, through Triton's interpreter, on CPU: `TRITON_INTERPRET=1 python -m
tests.decode_attention_check` (a separate process: the flag is read when the kernel module is
imported). Prints one JSON object: per case, the largest errors relative to the output's scale
(the kernel's and the masked path's against the reference, and between them). The RMSNorm kernel
(dflash_core/kernels/rms_norm.py), which the decoder's kernel path runs too, against the norm
classes' own forwards; the sampling kernel (dflash_core/kernels/gumbel_max.py) against the torch
ops it replaces."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import sys

import torch

from dflash_core.kernels.decode_attention import decode_attention
from dflash_core.regenerate.attention import slot_attention
from tests.tiny_decoders import tiny_llama, tiny_sliding_qwen3


def sliding_qwen3():
    """The decoder checks' Qwen3: one full and one sliding layer (each layer's kernels run through
    the interpreter, so no third layer of a kind already there)."""
    return tiny_sliding_qwen3(layers=2)


def reference(query, key, value, ranges, scale) -> torch.Tensor:
    """softmax(q k^T * scale) v over positions [lo, hi) of each sequence, in float64."""
    b, hq, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    q = query.double().view(b, hkv, hq // hkv, d)
    scores = torch.matmul(q, key.double().transpose(-1, -2)) * scale  # [b, hkv, g, L]
    pos = torch.arange(length, device=query.device)
    lo, hi = ranges[:, 0].long(), ranges[:, 1].long()
    seen = (pos >= lo[:, None]) & (pos < hi[:, None])
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), value.double()).view(b, hq, d)


def case(
    positions: list[int],
    groups: int,
    head_dim: int,
    kv_heads: int = 2,
    length: int = 200,
    window: int | None = None,
    splits: int | None = None,
    dtype=torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Sequences at `positions` (each sees its positions up to and with that one, or the last
    `window` of them) in a cache of `length`; the error of the kernel's output relative to the
    reference's largest magnitude, with the query and cache rounded to `dtype` for both."""
    g = torch.Generator().manual_seed(seed)
    b = len(positions)
    query = torch.randn(b, kv_heads * groups, head_dim, generator=g)
    key = torch.randn(b, kv_heads, length, head_dim, generator=g)
    value = torch.randn(b, kv_heads, length, head_dim, generator=g)
    hi = torch.tensor(positions) + 1
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    ranges = torch.stack([lo, hi], -1).to(torch.int32)
    # a strided query, as the attention layer's transpose of [B, 1, Hq, D] gives it
    query = query.to(device, dtype).unsqueeze(1).transpose(1, 2)[:, :, 0]
    key, value, ranges = key.to(device, dtype), value.to(device, dtype), ranges.to(device)
    scale = head_dim**-0.5
    # what lies outside a sequence's range must not count: poison it
    pos = torch.arange(length, device=device)
    outside = (pos < ranges[:, :1].long()) | (pos >= ranges[:, 1:].long())  # [b, L]
    key_p = key.masked_fill(outside[:, None, :, None], float("nan"))
    value_p = value.masked_fill(outside[:, None, :, None], float("nan"))
    got = decode_attention(query, key_p, value_p, ranges, scale, splits=splits)
    ref = reference(query, key, value, ranges, scale)
    # the masked path the decoder takes without the kernel, with its additive mask
    additive = torch.zeros(outside.shape, dtype=dtype, device=device).masked_fill(outside, float("-inf"))
    masked, _ = slot_attention(None, query.unsqueeze(2), key, value, additive.view(b, 1, 1, length), scale)
    top = ref.abs().max()
    return {
        "rel": float((got.double() - ref).abs().max() / top),
        "masked_rel": float((masked[:, 0].double() - ref).abs().max() / top),
        "vs_masked": float((got.double() - masked[:, 0].double()).abs().max() / top),
        "finite": bool(torch.isfinite(got).all()),
        "dtype_kept": got.dtype == dtype and tuple(got.shape) == tuple(ref.shape),
    }


def kernel_cases(device: str = "cpu") -> dict:
    """Positions 0 (one key), mid-cache, the cache's last, and split boundaries: with a cache of
    200 in 4 splits each split is 50 long, so positions 49 and 99 end exactly at one."""
    positions = [0, 49, 99, 137, 199]
    return {
        "gqa1_d64": case(positions, 1, 64, device=device),
        "gqa4_d128": case(positions, 4, 128, device=device, seed=1),
        "gqa4_d128_splits4": case(positions, 4, 128, splits=4, device=device, seed=2),
        "gqa1_d64_splits4": case(positions, 1, 64, splits=4, device=device, seed=3),
        "gqa4_d64_window": case(positions, 4, 64, window=40, device=device, seed=4),
        "gqa4_d64_window_splits4": case(positions, 4, 64, window=50, splits=4, device=device, seed=5),
        "gqa2_d80_odd_dims": case([3, 150], 2, 80, kv_heads=3, length=150, splits=3, device=device, seed=6),
        "fp32_splits7": case(positions, 4, 64, splits=7, dtype=torch.float32, device=device, seed=7),
        # fp32: exact products, so a position dropped or added shows far above the tolerance
        "fp32_window": case(positions, 4, 64, window=40, dtype=torch.float32, device=device, seed=10),
        "fp32_gqa1_window_splits4": case(
            positions, 1, 128, window=50, splits=4, dtype=torch.float32, device=device, seed=11
        ),
        "gqa4_d256_splits2": case([5, 70], 4, 256, length=100, splits=2, device=device, seed=9),
        # the default split count (16 of 256 positions: 3 slots of 2 kv heads fill no grid)
        "long_default_splits": case([0, 1000, 4095], 4, 128, kv_heads=2, length=4096, device=device, seed=8),
    }


def rows_cases(device: str = "cpu") -> dict:
    """Queries that name the cache row they read (ranges [B, 3]): 7 queries over 3 sequences'
    caches, several at different positions of one sequence (a chunked prefill's prompt tokens
    beside its decode queries), against the float64 reference over each query's row, gathered;
    and the same queries through the [B, 2] ranges over the gathered copy."""
    out = {}
    for dtype, splits, window in ((torch.bfloat16, None, None), (torch.float32, 3, None), (torch.float32, 1, 9)):
        g = torch.Generator().manual_seed(12)
        rows = torch.tensor([0, 2, 2, 2, 1, 0, 2])
        positions = torch.tensor([40, 0, 1, 17, 59, 3, 30])
        length, kv_heads, groups, d = 60, 2, 4, 64
        query = torch.randn(len(rows), kv_heads * groups, d, generator=g).to(device, dtype)
        key = torch.randn(3, kv_heads, length, d, generator=g).to(device, dtype)
        value = torch.randn(3, kv_heads, length, d, generator=g).to(device, dtype)
        hi = positions + 1
        lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
        two = torch.stack([lo, hi], -1).to(torch.int32).to(device)
        three = torch.stack([lo, hi, rows], -1).to(torch.int32).to(device)
        scale = d**-0.5
        got = decode_attention(query, key, value, three, scale, splits=splits)
        gathered = decode_attention(query, key[rows.to(device)], value[rows.to(device)], two, scale, splits=splits)
        ref = reference(query, key[rows.to(device)], value[rows.to(device)], two, scale)
        top = ref.abs().max()
        name = f"{str(dtype)[6:]}_splits{splits}_window{window}"
        out[name] = {
            "rel": float((got.double() - ref).abs().max() / top),
            "equals_gathered": bool(torch.equal(got, gathered)),
        }
    return out


# tokens the decoder check generates for prompt k: NEW_TOKENS + k (each sequence longer than the
# sliding window, and ending at a different step)
NEW_TOKENS = 6
KERNELS_NEW_TOKENS = 4  # decoder_kernels_case's, per prompt


def norm_cases(device: str = "cpu") -> dict:
    """The RMSNorm kernel through the norm dispatchers against transformers' norm classes (Llama's
    and Qwen3's weight after the cast, Gemma3's 1 + weight before it), bf16 and fp32, a row as wide
    as a hidden state and a per-head row, a width that is no power of two: the weighting each
    class was matched with, and the largest error relative to the output's scale."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_core.target_norms import NormKernels

    out = {}
    for cls in (LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm):
        for dtype in (torch.bfloat16, torch.float32):
            for width, rows in ((384, 5), (64, 37), (80, 3)):
                torch.manual_seed(width + rows)
                norm = cls(width, eps=1e-6)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(width) * 0.5 + (0.0 if cls is Gemma3RMSNorm else 1.0))
                holder = torch.nn.Sequential(norm).to(device=device, dtype=dtype)
                kernels = NormKernels.of(holder)
                x = (torch.randn(rows, 2, width) * 4).to(device=device, dtype=dtype)
                with torch.no_grad():
                    eager = norm(x)
                    with kernels.active():
                        fused = norm(x)
                scale = eager.float().abs().max().clamp(min=1e-6)
                out[f"{cls.__name__}_{str(dtype)[6:]}_{width}"] = {
                    "weighting": kernels.match()[cls.__name__],
                    "dtype_kept": fused.dtype == eager.dtype and fused.shape == eager.shape,
                    "rel": float((fused.float() - eager.float()).abs().max() / scale),
                }
    out.update(_sliced_norm_cases(device))
    return out


def _sliced_norm_cases(device: str) -> dict:
    """Per-head rows read in place from a slice of a wider projection's output (the query and key
    columns of the stacked q/k/v GEMM, target_qkv.py), heads of 64 and of 80 among wider rows: 6
    tokens of two heads (one program) and 300 tokens of three (programs whose rows cross tokens):
    read without a copy, and the same output as the kernel's over a contiguous copy, bit for bit."""
    from dflash_core.kernels.rms_norm import _rows, rms_norm

    out = {}
    for width in (64, 80):
        for tokens, heads_n in ((6, 2), (300, 3)):
            g = torch.Generator().manual_seed(width + tokens)
            wide = (torch.randn(tokens, 1, 5 * width, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
            heads = wide[..., width : (1 + heads_n) * width].view(tokens, 1, heads_n, width)
            weight = (torch.randn(width, generator=g) + 1).to(device=device, dtype=torch.bfloat16)
            sliced, copied = rms_norm(heads, weight, 1e-6), rms_norm(heads.contiguous(), weight, 1e-6)
            out[f"slice_{width}_{tokens}"] = {
                "strided": not heads.is_contiguous() and _rows(heads).data_ptr() == heads.data_ptr(),
                "equal": torch.equal(sliced, copied) and sliced.shape == heads.shape,
            }
    return out


def decoder_compare(
    device: str = "cpu", build=sliding_qwen3, ride_rows: int = 0, kernels=(True, False), widths=(3, 9, 1, 14, 6)
) -> dict:
    """Greedy tokens of the slot decoder with the kernel, with the masked path and of transformers'
    generate: 3 slots, 5 prompts of different lengths (so slots are refilled and idle ones decode
    too), sequences longer than the sliding window. ride_rows: refilled prompts ride in the
    decode steps (regenerate/ride.py), that many tokens a step; `rode` counts those steps.
    kernels: the paths run (the first is held against generate); widths: the prompts' lengths."""
    from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder

    model = build().to(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in widths]
    outputs = []
    rode = []
    for kernel in kernels:
        dec = SlotDecoder(
            model,
            slots=3,
            length=40,
            use_graph=False,
            attention_kernel=kernel,
            fused_kernels=kernel,
            ride_rows=ride_rows,
        )
        assert dec.attention_kernel is kernel and (dec.norms is not None) is kernel
        assert dec.cache.write_kernel is kernel  # the decode step's cache writes through slot_write
        done = dec.generate([Request(k, p, NEW_TOKENS + k) for k, p in enumerate(prompts)], Sampling(ignore_stop=True))
        outputs.append({c.key: c.tokens for c in done})
        rode.append(dec.riding_steps)
    generated = {}
    with torch.no_grad():
        for k, p in enumerate(prompts):
            ids = torch.tensor([p], device=device)
            n = NEW_TOKENS + k
            full = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            generated[k] = full[0, len(p) :].tolist()
    return {
        "equal": all(out == outputs[0] for out in outputs),
        "equals_generate": outputs[0] == generated,
        "tokens": sum(len(t) for t in outputs[0].values()),
        "rode": rode,
    }


def rope_cases(device: str = "cpu") -> dict:
    """The rotary kernel (kernels/rope.py) against transformers' own apply_rotary_pos_emb, at the
    decode step's shape (one position per row, the queries a transposed view as the attention
    layers hand them), a prefill's (several positions, cos shared by the rows) and one key-value
    head; and the dispatch (target_rope.py): which function a model's modules get, that it runs
    the kernel only while active, that fp16 and fp32 stay eager, and that a function rotating
    otherwise is refused."""
    from transformers.models.qwen3 import modeling_qwen3

    from dflash_core.kernels.rope import apply_rope

    out: dict = {}
    g = torch.Generator().manual_seed(3)
    for name, (b, h, hk, s, d, cos_rows) in {
        "decode": (6, 8, 2, 1, 128, 6),
        "prefill_shared_cos": (3, 4, 4, 7, 80, 1),
        "gqa1": (2, 4, 1, 3, 64, 2),
    }.items():
        q, k, cos, sin = _rope_inputs(g, device, b, h, hk, s, d, cos_rows)
        want = _own(modeling_qwen3)(q, k, cos, sin)
        got = apply_rope(q, k, cos, sin)
        out[name] = {
            "equal": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
            "strides_kept": all(_layout(a) == _layout(b) for a, b in zip(want, got, strict=True)),
        }
    out["dispatch"] = _dispatch_case(device, g)
    return out


def _rope_inputs(g, device, b, h, hk, s, d, cos_rows, dtype=torch.bfloat16):
    q = (torch.randn(b, s, h, d, generator=g) * 3).to(device=device, dtype=dtype).transpose(1, 2)
    k = (torch.randn(b, s, hk, d, generator=g) * 3).to(device=device, dtype=dtype).transpose(1, 2)
    angle = torch.randint(0, 4096, (cos_rows, s, 1), generator=g) * torch.rand(d // 2, generator=g)
    angle = torch.cat([angle, angle], dim=-1)  # the rotary embeddings' layout: the frequencies twice
    return q, k, angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)


def _own(home):
    from dflash_core.target_rope import original_of

    return original_of(home.apply_rotary_pos_emb)


def _dispatch_case(device: str, g) -> dict:
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    from dflash_core.target_rope import RopeKernels

    rope = RopeKernels(tiny_sliding_qwen3().to(device=device, dtype=torch.bfloat16))
    llama_before = _own(modeling_llama) is modeling_llama.apply_rotary_pos_emb
    rope_llama = RopeKernels(tiny_llama().to(device=device, dtype=torch.bfloat16))
    q, k, cos, sin = _rope_inputs(g, device, 3, 4, 2, 1, 32, 3)
    own = _own(modeling_qwen3)(q, k, cos, sin)
    usable = rope.usable(torch.bfloat16)  # probed here, before the calls are counted
    with _counting("dflash_core.kernels.rope", "apply_rope") as calls:
        inactive = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
        after_inactive = len(calls)
        with rope.active():
            active = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
            fp16 = modeling_qwen3.apply_rotary_pos_emb(*(t.half() for t in (q, k, cos, sin)))
        after_active = len(calls)
    upcast = RopeKernels(_family("upcast_rotary_family", _upcast_rotary).to(device=device, dtype=torch.bfloat16))
    interleaved = RopeKernels(_family("interleaved_rotary_family", _interleaved_rotary).to(device=device))
    decorated = RopeKernels(_family("decorated_rotary_family", _own(modeling_qwen3), decorated=True).to(device=device))
    return {
        "modules": rope.modules,
        "usable": usable,
        "fp16_usable": rope.usable(torch.float16),
        "fp32_usable": rope.usable(torch.float32),
        "qwen3_dispatching": _own(modeling_qwen3) is not modeling_qwen3.apply_rotary_pos_emb,
        "llama_untouched_before": llama_before,
        "llama_modules": rope_llama.modules,
        "llama_usable": rope_llama.usable(torch.bfloat16),
        "inactive_is_own": all(torch.equal(a, b) for a, b in zip(inactive, own, strict=True)),
        "active_is_own": all(torch.equal(a, b) for a, b in zip(active, own, strict=True)),
        "kernel_calls_inactive": after_inactive,
        "kernel_calls_active": after_active - after_inactive,  # the fp16 call is not one of them
        "fp16_is_own": all(
            torch.equal(a, b)
            for a, b in zip(fp16, _own(modeling_qwen3)(*(t.half() for t in (q, k, cos, sin))), strict=True)
        ),
        "upcast_modules": upcast.modules,
        "upcast_refused": not upcast.usable(torch.bfloat16),
        "interleaved_modules": interleaved.modules,
        "interleaved_refused": not interleaved.usable(torch.bfloat16),
        "decorated_modules": decorated.modules,
        "decorated_usable": decorated.usable(torch.bfloat16),
    }


@contextlib.contextmanager
def _counting(module: str, name: str, keep=lambda *args, **kwargs: 1):
    """The calls of module.name recorded, each as keep(its arguments) (the function itself still
    runs)."""
    home = importlib.import_module(module)
    inner, calls = getattr(home, name), []

    def counted(*args, **kwargs):
        calls.append(keep(*args, **kwargs))
        return inner(*args, **kwargs)

    setattr(home, name, counted)
    try:
        yield calls
    finally:
        setattr(home, name, inner)


def _count_stacked(dec) -> list:
    """The stacked q/k/v GEMMs a decoder runs (its FusedQkv's query calls), recorded."""
    calls: list = []
    if dec.qkv is None:
        return calls
    project = dec.qkv.project

    def counted(group, role, x):
        out = project(group, role, x)
        if role == 0:
            calls.append(group)
        return out

    dec.qkv.project = counted
    return calls


def decoder_kernels_case(device: str = "cpu") -> dict:
    """A bf16 Qwen3 decoder (sliding and full layers) with its layers' kernels against the same
    decoder with the rotary embeddings and the cache writes eager and its q/k/v projections as
    three GEMMs: the same greedy tokens (both kernels are exact; the norms read the stacked GEMM's
    columns in place), and the kernels seen to run in its prefills and decode steps. Fewer new
    tokens than the other decoder checks (both passes run every kernel through the interpreter):
    a few decode steps, with a slot refilled, are what it checks."""
    from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder

    model = sliding_qwen3().to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    # short prompts: every prompt token is a program of each layer's interpreted kernels
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 6, 2, 4)]
    outputs, counts = [], {}
    for fused in (True, False):
        dec = SlotDecoder(
            model, slots=3, length=40, use_graph=False, attention_kernel=True, fused_kernels=True, ride_rows=0
        )
        if not fused:
            dec.rope, dec.cache.write_kernel, dec.qkv = None, False, None
        stacked = _count_stacked(dec)
        with (
            _counting("dflash_core.kernels.rope", "apply_rope") as rope_calls,
            _counting("dflash_core.kernels.slot_write", "write_slots") as write_calls,
            _counting(
                "dflash_core.kernels.decode_attention",
                "decode_attention",
                lambda query, key, value, ranges, *args, **kwargs: ranges.view(-1, 2).tolist(),
            ) as ranges,
        ):
            done = list(
                dec.generate(
                    [Request(k, p, KERNELS_NEW_TOKENS) for k, p in enumerate(prompts)], Sampling(ignore_stop=True)
                )
            )
        outputs.append({c.key: c.tokens for c in done})
        entries = [r for call in ranges for r in call]
        counts["fused" if fused else "eager"] = {
            "rope": len(rope_calls),
            "writes": len(write_calls),
            "stacked": len(stacked),
            # slots parked (no sequence) read the one position they write; no other range ends there
            "parked_reads": sum(lo == dec.parked for lo, _ in entries),
            "parked_wider": sum(lo == dec.parked and hi != lo + 1 for lo, hi in entries),
            "whole_cache_idle": sum(hi == dec.length and lo != dec.parked for lo, hi in entries),
        }
    return {"equal": outputs[0] == outputs[1], "calls": counts, "tokens": sum(len(t) for t in outputs[0].values())}


def sampler_cases(device: str = "cpu") -> dict:
    """The sampling kernel (dflash_core/kernels/gumbel_max.py) against the torch ops it replaces,
    on the same device: logits in fp32 and bf16 (many equal values), a vocabulary inside one of
    the kernel's blocks and one over several with the last partial, entries at -inf (what top-k
    and top-p leave out) and a row with none left (index 0, as torch.argmax), three temperatures."""
    from dflash_core.kernels.gumbel_max import gumbel_argmax
    from dflash_core.regenerate.sampling import gumbel_noise

    g = torch.Generator().manual_seed(3)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (128, 9001):
            logits = (torch.randn(8, vocab, generator=g) * 4).to(dtype)
            logits[1, ::3] = float("-inf")
            logits[2] = float("-inf")
            seeds = torch.randint(0, 2**40, (8,), generator=g)
            steps = torch.randint(0, 10**6, (8,), generator=g)
            logits, seeds, steps = logits.to(device), seeds.to(device), steps.to(device)
            for t in (0.6, 1.0, 1.7):
                temp = torch.tensor([t], device=device)
                ref = (logits.float() / temp + gumbel_noise(seeds, steps, vocab)).argmax(-1)
                got = gumbel_argmax(logits, temp, seeds, steps)
                name = f"{str(dtype).removeprefix('torch.')}_{vocab}_t{t}"
                out[name] = {"equal": torch.equal(got, ref), "mismatches": int((got != ref).sum())}
    return out


def top_p_cases(device: str = "cpu") -> dict:
    """The top-p floor (dflash_core/kernels/top_p.py) against the sorted cut (sampling.keep_top),
    fp32, bf16 and fp16 logits (bf16: many ties, kept or cut whole by both), flat and peaked rows,
    -inf entries (a third of a row, and more than the kernel's first block), one block and
    several: the tokens each keeps, and the probability of those where they differ (a sum's
    rounding near top_p moves the cut by a few tail tokens at most); and -0.0 tied with 0.0."""
    from dflash_core.kernels.top_p import BLOCK, key_shift, top_p_floor
    from dflash_core.regenerate.sampling import keep_top

    g = torch.Generator().manual_seed(6)
    out = {}
    no_k = torch.zeros(1, dtype=torch.long, device=device)
    # one block, and two with the last partial (each program bisects over its whole row: the
    # interpreter's cost grows with the rows and the blocks)
    several = BLOCK + 404
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for vocab in (300, several) if dtype != torch.float16 else (300,):  # fp16: its key shift
            scale = torch.linspace(0.5, 8, 4).unsqueeze(-1)  # flat to peaked rows
            logits = (torch.randn(4, vocab, generator=g) * scale).to(dtype)
            logits[1, ::3] = float("-inf")
            # more than the kernel's first block at `several` (3/5 of the row at 300)
            logits[2, : max(vocab * 3 // 5, vocab - 300)] = float("-inf")
            logits = logits.to(device)
            bits = logits.float().view(torch.int32)
            bits = torch.where(bits == torch.iinfo(torch.int32).min, 0, bits)  # -0.0 keyed as 0.0
            keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> key_shift(dtype)
            for t, p in ((0.7, 0.5), (1.0, 0.9), (1.3, 0.99)):
                temp, top_p = torch.tensor([t], device=device), torch.tensor([p], device=device)
                kept = keys >= top_p_floor(logits, temp, top_p)[:, None]
                scaled = logits.float() / temp
                want = keep_top(scaled, no_k, top_p) > float("-inf")
                probs = scaled.softmax(-1)
                out[f"{str(dtype).removeprefix('torch.')}_{vocab}_p{p}"] = {
                    "differ": int((kept != want).sum()),
                    "differ_mass": float((probs * (kept != want)).sum(-1).max()),
                    "kept": int(kept.sum()),
                }
    # -0.0 ties with 0.0: at top_p 0.6 the two zeros (0.21 each, after 0.58) are kept together
    zeros = torch.tensor([[1.0, 0.0, -0.0, -5.0]], device=device)
    one, top_p = torch.ones(1, device=device), torch.tensor([0.6], device=device)
    bits = zeros.view(torch.int32)
    keys = torch.where(bits == torch.iinfo(torch.int32).min, 0, bits)
    out["signed_zero"] = {"kept": (keys >= top_p_floor(zeros, one, top_p)[:, None]).tolist()}
    return out


def decoder_sampler_case(device: str = "cpu") -> dict:
    """The slot decoder's sampled tokens with the sampling kernels and with the torch ops, from the
    whole distribution, cut to the top k (picked) and then top-p, to top-p alone (the floor, or
    sorted) and to a top-k past the picked ones (sorted): the kernel seen to run in each."""
    from dflash_core.regenerate.decode import Request, Sampling, SlotDecoder

    model = tiny_llama().to(device)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (4, 9, 2, 6)]
    result = {}
    for sampling in (
        Sampling(temperature=1.0, ignore_stop=True),
        Sampling(temperature=0.8, top_p=0.9, top_k=20, ignore_stop=True),
        Sampling(temperature=0.8, top_p=0.9, ignore_stop=True),
        Sampling(temperature=0.8, top_k=2000, ignore_stop=True),
    ):
        outputs, calls = [], []
        for kernel in (True, False):
            dec = SlotDecoder(model, slots=3, length=40, use_graph=False, attention_kernel=False, fused_kernels=False)
            dec.sample_kernel = dec.floor_kernel = kernel
            requests = [Request(k, p, KERNELS_NEW_TOKENS, seed=k) for k, p in enumerate(prompts)]
            with (
                _counting("dflash_core.kernels.gumbel_max", "gumbel_argmax") as seen,
                _counting("dflash_core.kernels.top_p", "top_p_floor") as floors,
            ):
                outputs.append({c.key: c.tokens for c in dec.generate(requests, sampling)})
            calls.append((len(seen), len(floors)))
        result[sampling.mode] = {
            "equal": outputs[0] == outputs[1],
            "kernel_calls": calls[0][0],
            "floor_calls": calls[0][1],
            "eager_calls": sum(calls[1]),
        }
    # the decoder's default where its kernels run: the kernel, once its probe drew the torch ops' tokens
    default = SlotDecoder(model, slots=2, length=8, use_graph=False, fused_kernels=True)
    result["default_on"] = default.sample_kernel and default.floor_kernel
    return result


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _upcast_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    rot = [(t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k)]
    return rot[0], rot[1]


def _interleaved_rotary(q, k, cos, sin):
    """GPT-J's form: pairs (2i, 2i + 1) rotated, where rotate_half pairs (i, i + D/2)."""

    def rotate(x):
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def _family(name: str, function, decorated: bool = False) -> torch.nn.Module:
    """A model of one attention class whose forward, written in the modeling module `name`, calls
    that module's `apply_rotary_pos_emb` (= function), as a transformers family's does; decorated:
    the class's forward is a wrapper written here (as transformers' decorators are elsewhere)."""
    import types

    home = types.ModuleType(name)
    home.apply_rotary_pos_emb = function
    source = "def forward(self, q, k, cos, sin):\n    return apply_rotary_pos_emb(q, k, cos, sin)\n"
    exec(compile(source, name, "exec"), home.__dict__)
    sys.modules[name] = home
    forward = _wrapped(home.forward) if decorated else home.forward
    attention = type(f"{name}_attention", (torch.nn.Module,), {"forward": forward})
    return torch.nn.Sequential(attention(), torch.nn.Linear(4, 4))


def _wrapped(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _layout(t: torch.Tensor) -> list[tuple[int, int]]:
    """(size, stride) of the dimensions longer than one: a size-1 dimension's stride is arbitrary."""
    return [(n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1]


def slot_write_cases(device: str = "cpu") -> dict:
    """The decode step's cache writes (kernels/slot_write.py) against the eager advanced-index put:
    the new rows as the rotary kernel and the value projection leave them (transposed views),
    a position outside the cache writing nothing."""
    from dflash_core.kernels.slot_write import write_slots

    g = torch.Generator().manual_seed(5)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        slots, heads, length, dim = 5, 3, 11, 40
        k = torch.randn(slots, heads, length, dim, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(slots, heads, length, dim, generator=g).to(device=device, dtype=dtype)
        k_new = torch.randn(slots, 1, heads, dim, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
        v_new = torch.randn(slots, 1, heads, dim, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
        positions = torch.tensor([0, 10, 4, 4, 7], device=device)
        want_k, want_v = k.clone(), v.clone()
        index = torch.arange(slots, device=device)
        want_k[index, :, positions] = k_new[:, :, 0]
        want_v[index, :, positions] = v_new[:, :, 0]
        write_slots(k, v, k_new, v_new, positions)
        kept_k, kept_v = k.clone(), v.clone()
        write_slots(k, v, k_new * 2, v_new * 2, torch.tensor([length, -1, length + 3, 99, -5], device=device))
        untouched = torch.equal(k, kept_k) and torch.equal(v, kept_v)
        # rows that name their slot: 3 rows into slots 4, 1 and 4 (a chunked prefill's two tokens)
        at_slots, at = torch.tensor([4, 1, 4], device=device), torch.tensor([2, 9, 3], device=device)
        want_k[at_slots, :, at] = k_new[:3, :, 0]
        want_v[at_slots, :, at] = v_new[:3, :, 0]
        write_slots(k, v, k_new[:3], v_new[:3], at, at_slots)
        written = torch.equal(k, want_k) and torch.equal(v, want_v)
        # a slot outside the cache writes nothing either
        write_slots(k, v, k_new[:2] * 3, v_new[:2] * 3, at[:2], torch.tensor([slots, -1], device=device))
        out[str(dtype)[6:]] = {
            "written": written,
            "outside_untouched": untouched and torch.equal(k, want_k) and torch.equal(v, want_v),
        }
    return out


if __name__ == "__main__":
    result = {"kernel": kernel_cases(), "norms": norm_cases(), "rope": rope_cases(), "slot_write": slot_write_cases()}
    result["rows"] = rows_cases()
    result["decoder_kernels"] = decoder_kernels_case()
    result["sampler"], result["decoder_sampler"] = sampler_cases(), decoder_sampler_case()
    result["top_p"] = top_p_cases()
    if "--decoder" in sys.argv:
        result["decoder"] = decoder_compare()
        result["decoder_one_kind"] = decoder_compare(build=tiny_llama)
        # the masked path with riding rows runs in tests/test_generate.py, outside the interpreter
        # (through the interpreter each step costs seconds: four prompts, the fourth riding over
        # four steps once the first ends)
        result["decoder_riding"] = decoder_compare(ride_rows=4, kernels=(True,), widths=(3, 9, 1, 14))
    print(json.dumps(result))
