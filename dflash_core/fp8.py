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


@torch.library.custom_op("dflash::fp8_products", mutates_args=())
def _fp8_products(
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    x8s: list[torch.Tensor],
    x_invs: list[torch.Tensor],
    w8s: list[torch.Tensor],
    w_invs: list[torch.Tensor],
    pairs: list[int],
) -> list[torch.Tensor]:
    """xs[i] @ ws[j]^T in bf16 for each (i, j) of `pairs` (flattened: i0, j0, i1, j1, ...), computed
    from the operands' FP8 casts (x8s, w8s with their inverse scales; `quantize`), xs [M, K]. xs
    and ws enter only for the gradient, which the operator defines (`_fp8_products_backward`).

    An operator rather than a custom autograd Function, because torch.compile takes an operator as
    one opaque node where it would trace (speculate) a Function's forward and backward in Python
    at every cold compile and every warm start's trace of the layer. The casts stay outside it, in
    the compiled graph with the ops around them, and the backward's casts and GEMMs are traced
    into the compiled backward graph as ordinary ops."""
    return [
        scaled_mm(x8s[i], x_invs[i], w8s[j].t(), w_invs[j], torch.bfloat16) for i, j in zip(pairs[::2], pairs[1::2])
    ]


@_fp8_products.register_fake
def _(xs, ws, x8s, x_invs, w8s, w_invs, pairs):
    return [
        x8s[i].new_empty((x8s[i].shape[0], w8s[j].shape[0]), dtype=torch.bfloat16)
        for i, j in zip(pairs[::2], pairs[1::2])
    ]


def _fp8_products_saves(ctx, inputs, output) -> None:
    xs, ws, x8s, x_invs, w8s, w_invs, pairs = inputs
    ctx.pairs = list(zip(pairs[::2], pairs[1::2]))
    ctx.n_inputs = len(xs)
    ctx.needs_x = [x.requires_grad for x in xs]
    ctx.needs_w = [w.requires_grad for w in ws]
    ctx.weight_is_fp32 = [w.dtype == torch.float32 for w in ws]  # fp32 masters take fp32 gradients
    ctx.save_for_backward(*x8s, *x_invs, *w8s, *w_invs)  # the casts: half the bytes of bf16 activations


def _fp8_products_backward(ctx, grads: list[torch.Tensor]):
    """The backward's GEMMs in FP8 too: grad_x = g @ W, grad_W = g^T @ x, each product's g cast
    once, each operand laid out column-major once, a shared operand's gradient summed over the
    products it enters."""
    n, saved = ctx.n_inputs, ctx.saved_tensors
    m = (len(saved) - 2 * n) // 2
    x8s, x_invs, w8s, w_invs = saved[:n], saved[n : 2 * n], saved[2 * n : 2 * n + m], saved[2 * n + m :]
    grad_x: list[torch.Tensor | None] = [None] * n
    grad_w: list[torch.Tensor | None] = [None] * m
    w_cols: dict[int, torch.Tensor] = {}
    x_cols: dict[int, torch.Tensor] = {}
    for (i, j), grad_out in zip(ctx.pairs, grads, strict=True):
        g8, g_inv = quantize(grad_out.contiguous(), GRAD_DTYPE)  # the GEMM takes g8 row-major
        if ctx.needs_x[i]:
            if j not in w_cols:
                w_cols[j] = column_major(w8s[j])
            part = scaled_mm(g8, g_inv, w_cols[j], w_invs[j], torch.bfloat16)
            grad_x[i] = part if grad_x[i] is None else grad_x[i] + part
        if ctx.needs_w[j]:
            if i not in x_cols:
                x_cols[i] = column_major(x8s[i])
            out_dtype = torch.float32 if ctx.weight_is_fp32[j] else torch.bfloat16
            part = scaled_mm(g8.t().contiguous(), g_inv, x_cols[i], x_invs[i], out_dtype)
            grad_w[j] = part if grad_w[j] is None else grad_w[j] + part
    casts_x, casts_w = [None] * n, [None] * m  # the casts and their scales take no gradient
    return grad_x, grad_w, casts_x, casts_x, casts_w, casts_w, None


_fp8_products.register_autograd(_fp8_products_backward, setup_context=_fp8_products_saves)


def fp8_products(
    inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, ...]:
    """inputs[i] @ weights[j].T for each (i, j) in pairs, as FP8 GEMMs (the backward's too). Each
    input and each weight is cast once for all the products it enters (a drafter layer's block
    states feed q, k and v; the target features k and v; k's and v's weights two inputs each): the
    same cast as one per product, with fewer passes over the activations."""
    rows = [x.reshape(-1, x.shape[-1]) for x in inputs]
    x8s, x_invs = zip(*(quantize(x.detach(), FORWARD_DTYPE) for x in rows), strict=True)
    w8s, w_invs = zip(*(quantize(w.detach(), FORWARD_DTYPE) for w in weights), strict=True)
    flat = [k for pair in pairs for k in pair]
    outs = torch.ops.dflash.fp8_products(rows, list(weights), list(x8s), list(x_invs), list(w8s), list(w_invs), flat)
    return tuple(out.view(*inputs[i].shape[:-1], weights[j].shape[0]) for out, (i, j) in zip(outs, pairs, strict=True))


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
