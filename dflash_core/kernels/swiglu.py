"""A gated MLP's product `act(gate) * up` in one Triton kernel, SiLU as the activation.

Eager, transformers' gated MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`: Llama, Qwen,
Mistral and their MoE experts) runs the activation and the product as two kernels over the
intermediate width: the activation reads the gate's output and writes its own, the product reads
that and the up projection's output and writes the result. This kernel reads the two
projections' outputs once and writes the product once: two of the five passes over the widest
activation of the layer go, and a launch.

bf16 only, rounded where the eager ops round: SiLU is computed in fp32 as torch's CUDA kernel
computes it (`x / (1 + exp(-x))`, an IEEE division, libdevice's exp) and rounded to bf16, then the
product of two bf16 values (exact in fp32) is rounded once. Both roundings are integer
arithmetic on the fp32 bits: Triton's compiler folds a cast to bf16 and back, and its CPU
interpreter casts to bf16 by truncation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import triton_launch_device
from . import runs_on  # noqa: F401 - where callers ask it

DTYPES = (torch.bfloat16,)
_BLOCK = 2048


@triton.jit
def _rounded(x):
    """fp32 x rounded to bf16 (nearest, ties to even), as fp32. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["n"])
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    g = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
    act = _rounded(tl.div_rn(g, 1.0 + tl.exp(-g)))
    # rounded by hand before the store too: Triton's interpreter casts to bf16 by truncation
    tl.store(out_ptr + at, _rounded(act * u).to(out_ptr.dtype.element_ty), mask=ok)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes these: two contiguous tensors of one shape, dtype (bf16) and device."""
    return (
        gate.dtype in DTYPES
        and up.dtype == gate.dtype
        and up.shape == gate.shape
        and up.device == gate.device
        and gate.is_contiguous()
        and up.is_contiguous()
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as the eager ops round it (see the module's doc); `supports` must hold."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        with triton_launch_device(gate.device):
            _silu_mul_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, n, BLOCK=_BLOCK)
    return out
