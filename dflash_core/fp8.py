"""FP8 in the drafter step: which devices and shapes can take it, and the drafter's linear layers
as tensorwise-scaled FP8 GEMMs (`torch._scaled_mm`).

Why tensorwise: one scale per tensor is one amax reduction that torch.compile fuses with the cast
into the kernel that already touches the tensor, and cuBLAS takes the scales as device tensors, so
the step never waits for the host (the recorded step graph needs that). Rowwise scaling costs more
per GEMM on Hopper than it gains here.

Every operand is e4m3, gradients too: with a scale per tensor that maps its largest value to the
format's largest, e4m3's extra mantissa bit gave gradients closer to the exact ones than e5m2's
extra range did, heavy-tailed gradients and the softmax gradient over a 152k vocabulary included
(docs/performance.md has the comparison).
Weights stay as they are (fp32 masters, bf16 working copies, the optimizer unchanged): each step
casts the working copy it GEMMs with, so the weights of record never lose precision to FP8.
Shapes FP8 cannot take (any GEMM dimension not a multiple of 16) and steps without gradients
(evaluation, at other shapes) run the plain bf16 GEMM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor-core matmuls
FP8_MULTIPLE = 16  # cuBLAS's FP8 GEMMs take dimensions that are multiples of 16
FORWARD_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e4m3fn


def fp8_device_problem(devices: Iterable[str], capability: Callable[[str], tuple[int, int]]) -> str | None:
    """Why FP8 GEMMs cannot run on `devices` (None: they can); capability(device) is the CUDA
    compute capability of a CUDA device."""
    for device in devices:
        if not str(device).startswith("cuda"):
            return f"{device} is not a GPU (FP8 GEMMs need compute capability 8.9 or newer)"
        cap = tuple(capability(device))
        if cap < FP8_MIN_CAPABILITY:
            return f"{device} has compute capability {cap[0]}.{cap[1]}; FP8 matmuls need 8.9 or newer (Ada, Hopper)"
    return None


def cuda_capability(device: str) -> tuple[int, int]:
    if not torch.cuda.is_available():
        raise ValueError(f"{device}: CUDA is not available")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return major, minor


def check_fp8_devices(devices: Iterable[str], setting: str) -> None:
    """ValueError naming `setting` where a device cannot run FP8 GEMMs."""
    why = fp8_device_problem(devices, cuda_capability)
    if why is not None:
        raise ValueError(f'{setting} = "fp8": {why}')


def fp8_shape_problems(gemm_dims: dict[str, int]) -> list[str]:
    """The named GEMM dimensions that are not multiples of 16."""
    return [f"{name} = {value}" for name, value in gemm_dims.items() if value % FP8_MULTIPLE]


def drafter_gemm_dims(cfg, seq_len: int, num_anchors: int, block_size: int) -> dict[str, int]:
    """Every dimension of the drafter step's GEMMs, by what sets it (cfg: a DrafterConfig)."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim,
        "num_key_value_heads * head_dim": cfg.num_key_value_heads * cfg.head_dim,
        "seq_len": seq_len,
        "num_anchors * block_size": num_anchors * block_size,
        # the loss's rows: the blocks' drafting slots (B - 1 fill_in, B anchor_first)
        "num_anchors * drafted tokens": num_anchors * cfg.block_layout.drafted(block_size),
    }


def check_fp8_shapes(cfg, seq_len: int, num_anchors: int, block_size: int) -> None:
    bad = fp8_shape_problems(drafter_gemm_dims(cfg, seq_len, num_anchors, block_size))
    if bad:
        raise ValueError(
            'precision = "fp8": the drafter step\'s GEMM dimensions must be multiples of '
            f"{FP8_MULTIPLE}; not {', '.join(bad)}"
        )


# ---------------------------------------------------------------------------- tensorwise casts


def scale_for(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scalar s with |t * s| <= dtype's largest value (on t's device; no host sync)."""
    amax = t.detach().abs().amax().float()
    return torch.finfo(dtype).max / amax.clamp(min=1e-12)


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in FP8, the inverse of its scale): t ~= t8.float() * inv_scale."""
    scale = scale_for(t, dtype)
    return to_fp8(t, scale, dtype), scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (cuBLAS's FP8 GEMMs take B that way)."""
    return t.t().contiguous().t()


def scaled_mm(a8, a_inv, b8, b_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b for a row-major [M, K] and b column-major [K, N], both FP8 with inverse scales."""
    return torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Fp8Products(torch.autograd.Function):
    """y_p = x_i W_j^T for each product p = (i, j) of `pairs`, with FP8 operands; the backward's
    GEMMs in FP8 too. Each input and each weight is cast once for all the products it enters (a
    drafter layer's block states feed q, k and v; the target features k and v; k's and v's weights
    two inputs each), which is the same cast as one per product, once instead of several times:
    fewer passes over the activations and, under torch.compile, fewer custom Functions for dynamo
    to trace. Saves the FP8 casts (half the bytes of bf16 activations)."""

    @staticmethod
    def forward(ctx, pairs: tuple[tuple[int, int], ...], n_inputs: int, *tensors: torch.Tensor):
        xs, ws = tensors[:n_inputs], tensors[n_inputs:]
        x8s = [quantize(x.reshape(-1, x.shape[-1]), FORWARD_DTYPE) for x in xs]
        w8s = [quantize(w, FORWARD_DTYPE) for w in ws]
        outs = []
        for i, j in pairs:
            (x8, x_inv), (w8, w_inv) = x8s[i], w8s[j]
            out = scaled_mm(x8, x_inv, w8.t(), w_inv, torch.bfloat16)
            outs.append(out.view(*xs[i].shape[:-1], ws[j].shape[0]))
        ctx.pairs, ctx.n_inputs = pairs, n_inputs
        ctx.weight_is_fp32 = tuple(w.dtype == torch.float32 for w in ws)
        ctx.save_for_backward(*(t for cast in x8s + w8s for t in cast))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        saved, n = ctx.saved_tensors, ctx.n_inputs
        x8s = [(saved[2 * i], saved[2 * i + 1]) for i in range(n)]
        w8s = [(saved[2 * (n + j)], saved[2 * (n + j) + 1]) for j in range(len(ctx.weight_is_fp32))]
        needs_x, needs_w = ctx.needs_input_grad[2 : 2 + n], ctx.needs_input_grad[2 + n :]
        grad_x: list[torch.Tensor | None] = [None] * n
        grad_w: list[torch.Tensor | None] = [None] * len(w8s)
        w_cols: dict[int, torch.Tensor] = {}  # each operand laid out column-major once
        x_cols: dict[int, torch.Tensor] = {}
        for (i, j), grad_out in zip(ctx.pairs, grads, strict=True):
            g8, g_inv = quantize(grad_out.reshape(-1, grad_out.shape[-1]), GRAD_DTYPE)
            if needs_x[i]:
                w8, w_inv = w8s[j]
                if j not in w_cols:
                    w_cols[j] = column_major(w8)
                part = scaled_mm(g8, g_inv, w_cols[j], w_inv, torch.bfloat16).view(*grad_out.shape[:-1], w8.shape[1])
                grad_x[i] = part if grad_x[i] is None else grad_x[i] + part
            if needs_w[j]:
                x8, x_inv = x8s[i]
                if i not in x_cols:
                    x_cols[i] = column_major(x8)
                out_dtype = torch.float32 if ctx.weight_is_fp32[j] else torch.bfloat16
                part = scaled_mm(g8.t().contiguous(), g_inv, x_cols[i], x_inv, out_dtype)
                grad_w[j] = part if grad_w[j] is None else grad_w[j] + part
        return (None, None, *grad_x, *grad_w)


def fp8_products(
    inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, ...]:
    """inputs[i] @ weights[j].T for each (i, j) in pairs, as FP8 GEMMs sharing their casts."""
    return _Fp8Products.apply(tuple(pairs), len(inputs), *inputs, *weights)


def fp8_fits(rows: int, weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return rows % FP8_MULTIPLE == 0 and n % FP8_MULTIPLE == 0 and k % FP8_MULTIPLE == 0


class Fp8Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint keys) whose training GEMMs run in FP8."""

    def takes_fp8(self, x: torch.Tensor) -> bool:
        """Whether this call's GEMMs run in FP8: a training step (gradients on) at a shape FP8 takes."""
        return self.bias is None and torch.is_grad_enabled() and fp8_fits(x.numel() // x.shape[-1], self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_fp8(x):
            return fp8_products((x,), (self.weight,), ((0, 0),))[0]
        return F.linear(x, self.weight, self.bias)


def linear_products(inputs: Sequence[torch.Tensor], products: Sequence[tuple[nn.Linear, int]]) -> list[torch.Tensor]:
    """linear(inputs[i]) for each (linear, i) of `products`: one group of FP8 GEMMs that cast every
    input and weight once where each linear is an Fp8Linear taking FP8 for its input, else each
    linear called on its own (the bf16 step: the same calls as written one by one)."""
    if not all(isinstance(lin, Fp8Linear) and lin.takes_fp8(inputs[i]) for lin, i in products):
        return [lin(inputs[i]) for lin, i in products]
    linears: list[nn.Linear] = []
    pairs = []
    for lin, i in products:
        if not any(lin is seen for seen in linears):
            linears.append(lin)
        pairs.append((i, next(k for k, seen in enumerate(linears) if seen is lin)))
    return list(fp8_products(inputs, [lin.weight for lin in linears], pairs))


def use_fp8_linears(model: nn.Module) -> int:
    """Turns every bias-free nn.Linear of `model` into an Fp8Linear in place (the parameters, their
    names and identities unchanged); how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            module.__class__ = Fp8Linear
            n += 1
    return n


# ---------------------------------------------------------------------------- the frozen lm_head


@dataclass(frozen=True)
class Fp8Head:
    """The frozen lm_head [V, H] quantized once, with one scale, in the two layouts its GEMMs
    take: `rows` [V', H] (logits = h @ rows^T) and `cols` [H, V'] (grad_h = g @ cols^T), V'
    the vocabulary padded with zero rows to a multiple of 16 (the loss kernel reads the first
    `vocab` columns only)."""

    rows: torch.Tensor
    cols: torch.Tensor
    inv_scale: torch.Tensor
    vocab: int


@torch.no_grad()
def quantize_head(lm_head_weight: torch.Tensor) -> Fp8Head:
    vocab, hidden = lm_head_weight.shape
    padded = -(-vocab // FP8_MULTIPLE) * FP8_MULTIPLE
    w = lm_head_weight
    if padded != vocab:
        w = torch.cat([w, w.new_zeros(padded - vocab, hidden)])
    w8, inv = quantize(w, FORWARD_DTYPE)
    return Fp8Head(rows=w8, cols=w8.t().contiguous(), inv_scale=inv, vocab=vocab)


def head_logits(h8: torch.Tensor, h_inv: torch.Tensor, head: Fp8Head) -> torch.Tensor:
    """Logits [rows, vocab] in bf16 of hidden states h8 (e4m3, inverse scale h_inv): a view of
    the GEMM's [rows, V'] output without the padding columns (row stride V'), for kernels that
    take strides and softmaxes that must not see the padding's zero logits."""
    return scaled_mm(h8, h_inv, head.rows.t(), head.inv_scale, torch.bfloat16)[:, : head.vocab]


def head_grad(grad8: torch.Tensor, grad_inv: torch.Tensor, head: Fp8Head) -> torch.Tensor:
    """grad_h [rows, H] in bf16 of a logits gradient [rows, V'] in FP8 (inverse scale grad_inv;
    zeros in the padding columns, so the head's zero rows add nothing)."""
    return scaled_mm(grad8, grad_inv, head.cols.t(), head.inv_scale, torch.bfloat16)
