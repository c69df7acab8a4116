"""The target run in FP8 (`[engine] target_precision = "fp8"`): a bf16 target's decoder linears
quantized once at load, so the drafter trains on the features of an FP8-served target.

The scheme is the one serving engines apply to a bf16 checkpoint they are asked to serve in FP8
(vLLM's online `--quantization fp8`): e4m3 weights with one scale per matrix, and activations
cast with one dynamic scale per tensor, the GEMM a cuBLAS FP8 GEMM (`torch._scaled_mm`) that
returns the activations' dtype. On CUDA the cast is two Triton passes (kernels/fp8_cast.py), once
per tensor: q, k and v (gate and up) share theirs. The embedding, the final norm and the LM head
stay as they are (the drafter's frozen head reads them). The features differ from the bf16
target's by FP8's rounding: that is the point, and the reason it is a setting and never a default.

A checkpoint stored in fine-grained FP8 (a `quantization_config` with quant_method "fp8", e4m3
weights with a scale per 128 x 128 block, activations cast per token and 128 columns) runs so with
"as_loaded": `load_fp8_checkpoint` reads it and computes each of its linears with the serving
engines' numerics (`ActQuantLinear`), without transformers' FP8 kernels, which come from the hub
at run time and are absent on an offline machine.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FORWARD_DTYPE, FP8_MULTIPLE, quantize


class InputCasts:
    """The activation a decoder linear last cast to FP8, kept per thread, so the linears a layer
    feeds the same tensor (q, k and v; gate and up) cast it once. An entry is reused only for
    the same tensor object at the same version (not modified in place since), and it holds that
    tensor, so its memory cannot be reused under it; `clear()` drops it after each forward."""

    def __init__(self) -> None:
        self._local = threading.local()

    def cast(self, x: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(x as [rows', cols] FP8 with zero rows up to a multiple of 16, its inverse scale, rows)."""
        version = _version(x)
        entry = getattr(self._local, "entry", None)
        if entry is not None and entry[0] is x and version is not None and entry[1] == version:
            return entry[2]
        if x.is_cuda:
            from .kernels.fp8_cast import quantize_rows

            x2, rows, padded = _rows(x, cols)
            x8, inv = quantize_rows(x2, FORWARD_DTYPE, padded)
            result = (x8, inv, rows)
        else:  # the same values through torch ops (CPU tests; the engine refuses FP8 on a CPU)
            result = cast_rows(x, cols)
        self._local.entry = (x, version, result) if version is not None else None
        return result

    def clear(self) -> None:
        self._local.entry = None


def cast_rows(x: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """InputCasts.cast's result through torch ops (the formula of the CUDA kernel, whose scale's
    division may round differently than the compiled one): what a compiled graph traces. Inductor fuses
    the casts of one x for the linears it feeds (q, k and v) with the op that produces x into one
    kernel, which is what the cache saves eagerly."""
    x2, rows, padded = _rows(x, cols)
    x8, inv = quantize(F.pad(x2, (0, 0, 0, padded - rows)), FORWARD_DTYPE)
    return x8, inv, rows


def _rows(x: torch.Tensor, cols: int) -> tuple[torch.Tensor, int, int]:
    """x as rows of `cols`, their count, and that count padded to what FP8 GEMMs take (multiples
    of FP8_MULTIPLE)."""
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    return x2, rows, rows + (-rows % FP8_MULTIPLE)


def _version(x: torch.Tensor) -> int | None:
    """x's in-place version counter; None for inference-mode tensors, which keep none."""
    try:
        return x._version
    except RuntimeError:
        return None


class Fp8FrozenLinear(nn.Module):
    """A frozen nn.Linear as an FP8 GEMM: the weight quantized once (buffers, no parameters), the
    input cast through the layer stack's shared InputCasts, or inside a compiled graph (the fused
    layers, target_fusion.py) by the graph's own ops, which dynamo traces where it cannot trace
    the cache (per thread, by tensor identity)."""

    weight8: torch.Tensor
    weight_inv_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, casts: InputCasts):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.casts = casts
        weight8, inv = quantize(linear.weight.detach(), FORWARD_DTYPE)
        self.register_buffer("weight8", weight8)
        self.register_buffer("weight_inv_scale", inv)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            x8, x_inv, rows = cast_rows(x, self.in_features)
        else:
            x8, x_inv, rows = self.casts.cast(x, self.in_features)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        out = torch._scaled_mm(
            x8, self.weight8.t(), scale_a=x_inv, scale_b=self.weight_inv_scale, bias=bias, out_dtype=x.dtype
        )
        return out[:rows].view(*x.shape[:-1], self.out_features)


def fp8_convertible(linear: nn.Linear) -> bool:
    return linear.in_features % FP8_MULTIPLE == 0 and linear.out_features % FP8_MULTIPLE == 0


@torch.no_grad()
def quantize_decoder_linears(layers: nn.ModuleList) -> InputCasts | None:
    """Replaces every nn.Linear inside the decoder layers (whose widths FP8 takes) by an
    Fp8FrozenLinear on the same device, freeing its bf16 weight; the InputCasts they share (the
    caller clears it after each forward), None where no linear was replaced."""
    casts, count = InputCasts(), 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and fp8_convertible(child):
                    setattr(parent, name, Fp8FrozenLinear(child, casts))
                    count += 1
    return casts if count else None


# ---------------------------------------------------------------------------- FP8 checkpoints


def without_quantization(config: Any) -> Any:
    """A copy of a transformers config without its `quantization_config`."""
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    return plain


def fp8_checkpoint_blocks(config: Any) -> tuple[int, int] | None:
    """The weight block size of a checkpoint stored in fine-grained FP8 (config.json's
    `quantization_config` with quant_method "fp8"); None for any other checkpoint."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        return None
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"an FP8 checkpoint with activation_scheme {q.get('activation_scheme')!r}: only dynamic")
    block = q.get("weight_block_size", (128, 128))
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size must be two positive integers, not {block!r}"
        )
    return int(block[0]), int(block[1])


class ActQuantLinear(nn.Module):
    """A linear layer of an FP8 checkpoint, computed as the serving engines compute it: weights
    e4m3 with a scale per weight block (dequantized once, at load), activations cast to e4m3 per
    token and group of `group` input columns with dynamic scales. The GEMM itself runs on the
    dequantized operands in the activations' dtype, so the output is the FP8 GEMM's up to that
    dtype's rounding of FP8 values, on any device, without transformers' FP8 kernels."""

    def __init__(self, linear: nn.Linear, group: int):
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(fake_quantize_groups(x, self.group))


def fake_quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded through e4m3 with one dynamic scale per row and group of columns."""
    cols = x.shape[-1]
    if cols % group:
        raise ValueError(f"FP8 activation groups of {group} do not divide {cols} columns")
    g = x.float().reshape(*x.shape[:-1], cols // group, group)
    limit = torch.finfo(FORWARD_DTYPE).max
    scale = limit / g.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    q = (g * scale).clamp(-limit, limit).to(FORWARD_DTYPE).float() / scale
    return q.reshape(x.shape).to(x.dtype)


def dequantize_blocks(
    weight8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, blocks: tuple[int, int]
) -> torch.Tensor:
    """A [rows, cols] FP8 weight times its [ceil(rows / br), ceil(cols / bc)] scales, one per
    br x bc block (`blocks`, the checkpoint's weight_block_size; the last row and column of
    blocks may be partial)."""
    rows, cols = weight8.shape
    br, bc = blocks
    if tuple(scale_inv.shape) != (-(-rows // br), -(-cols // bc)):
        raise ValueError(
            f"FP8 weight [{rows}, {cols}] with {br} x {bc} blocks needs scales "
            f"[{-(-rows // br)}, {-(-cols // bc)}], not {list(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight8.float() * scales).to(dtype)


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_SUFFIX = "_scale_inv"


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; ValueError naming the file when its header is corrupt
    or the file is shorter than its header says (a truncated copy)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open has keys()
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def check_safetensors_files(path: Path, *, float_weights: bool = True) -> None:
    """Every safetensors file of a checkpoint directory has a readable header that its size
    covers, and (float_weights: a checkpoint that declares no quantization) floating-point
    weights: an FP8 or integer weight would be cast to the compute dtype as raw codes, without
    the scales that give it its value. ValueError naming the file, and the tensor (read before a
    loader that would name neither)."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    dtype = f.get_slice(key).get_dtype() if float_weights else ""
                    floating = dtype.startswith(("F16", "BF16", "F32", "F64"))
                    if float_weights and key.endswith((".weight", ".bias")) and not floating:
                        raise ValueError(
                            f"{file}: {key}: a {dtype} weight in a checkpoint whose config.json declares no "
                            "quantization_config (its values would be raw codes without their scales)"
                        )
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _scale_problem(weight: torch.Tensor, scale: torch.Tensor, blocks: tuple[int, int]) -> str | None:
    """Why `scale` cannot be the block scales of the FP8 `weight` (None: it can)."""
    if weight.dtype != FORWARD_DTYPE:
        return f"a weight with block scales must be float8_e4m3fn, not {weight.dtype}"
    if weight.dim() != 2:
        return f"an FP8 weight must be a matrix, not of shape {list(weight.shape)}"
    if scale.dtype not in SCALE_DTYPES:
        return f"its scales must be floating point (float32, bfloat16 or float16), not {scale.dtype}"
    rows, cols = weight.shape
    grid = (-(-rows // blocks[0]), -(-cols // blocks[1]))
    if tuple(scale.shape) != grid:
        return (
            f"FP8 weight [{rows}, {cols}] with {blocks[0]} x {blocks[1]} blocks needs scales "
            f"{list(grid)}, not {list(scale.shape)}"
        )
    values = scale.float()
    if not bool(torch.isfinite(values).all()):
        return "its scales hold NaN or infinite values"
    if not bool((values > 0).all()):
        return "its scales must be positive; some are 0 or negative"
    return None


def read_fp8_checkpoint(
    path: Path, dtype: torch.dtype, blocks: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The checkpoint's tensors with every FP8 weight dequantized (its `weight_scale_inv` per
    block of `blocks` folded in), and the names of those weights. Only e4m3 weights with finite
    positive floating-point scales of their block grid's shape are accepted: anything else
    (scales stored as integers, an integer or e5m2 weight beside its scales, an e4m3 weight
    without them, an integer weight) would load as numbers that are not the target's, so it is
    a ValueError naming the file and the tensor."""
    raw: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        for key, value in read_safetensors(file).items():
            raw[key], where[key] = value, file
    state: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    for key, value in raw.items():
        if key.endswith(SCALE_SUFFIX):
            if key[: -len(SCALE_SUFFIX)] not in raw:
                raise ValueError(f"{where[key]}: {key}: block scales of no weight ({key[: -len(SCALE_SUFFIX)]})")
            continue
        scale = raw.get(key + SCALE_SUFFIX)
        if scale is not None:
            problem = _scale_problem(value, scale, blocks)
            if problem is not None:
                raise ValueError(f"{where[key]}: {key}: {problem}")
            state[key] = dequantize_blocks(value, scale, dtype, blocks)
            quantized.add(key)
        elif value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            raise ValueError(f"{where[key]}: {key}: an FP8 tensor without block scales ({key}{SCALE_SUFFIX})")
        elif not value.is_floating_point() and key.endswith((".weight", ".bias")):
            raise ValueError(f"{where[key]}: {key}: a {value.dtype} tensor where weights are floating point")
        else:
            state[key] = value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    return state, quantized


@torch.no_grad()
def load_fp8_checkpoint(path: Path, config: Any, dtype: torch.dtype, attn: str, blocks: tuple[int, int]) -> nn.Module:
    """A causal LM from a fine-grained FP8 checkpoint, its FP8 linears as ActQuantLinear (on the
    default device; the caller moves it)."""
    from transformers import AutoModelForCausalLM

    plain = without_quantization(config)
    model = AutoModelForCausalLM.from_config(plain, dtype=dtype, attn_implementation=attn)
    state, quantized = read_fp8_checkpoint(path, dtype, blocks)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(plain, "tie_word_embeddings", False) and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{path}: the FP8 checkpoint does not match its config.json (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    if tied:
        model.tie_weights()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and f"{full}.weight" in quantized:
                setattr(module, child_name, ActQuantLinear(child, blocks[1]))
    return model
