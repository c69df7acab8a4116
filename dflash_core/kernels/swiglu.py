"""A gated MLP's activation, `silu(gate) * up`, in one Triton kernel.

Eager, transformers' gated MLP (Llama, Qwen, Mistral and their kin) computes `act_fn(gate_proj(x))
* up_proj(x)` as two kernels between its GEMMs: the SiLU reads the gate and writes its result,
the product reads that and the up projection and writes again. At a decode step's few hundred
rows and an intermediate width of ten thousand or more, that is two launches and two passes over
the widest activation of the layer. This kernel reads the gate and the up projection once and
writes the product once.

bf16 only, rounded where the eager ops round: the SiLU in fp32 as torch's CUDA kernel computes it
(`x / (1 + exp(-x))`, a correctly rounded division and the CUDA math library's `expf`), rounded to
bf16, then the product of two bf16 values (exact in fp32) rounded once. So on CUDA the output
equals the eager one bit for bit; the dispatcher (target_mlp.py) still takes it only where a probe
shows that. The first rounding is integer arithmetic on the fp32 bits, as in kernels/rope.py: a
cast to bf16 and back would be folded away by Triton's compiler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..devices import triton_launch_device
from . import INTERPRETED, runs_on  # noqa: F401 - where callers ask it
from .rope import _rounded

DTYPES = (torch.bfloat16,)
_BLOCK = 2048


@triton.jit(do_not_specialize=["n"])
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, MATH_LIBRARY: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    at = start + tl.arange(0, BLOCK)
    ok = at < n
    g = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
    # tl.exp is an approximation on CUDA (ex2.approx); the math library's expf is what torch calls.
    # Triton's interpreter has no math library: numpy's exp stands for it there
    if MATH_LIBRARY:  # noqa: SIM108 - a static branch of the jit function
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = _rounded(tl.div_rn(g, 1.0 + e))
    # rounded here too, not by the store's cast: Triton's interpreter truncates there
    tl.store(out_ptr + at, _rounded(silu * u).to(out_ptr.dtype.element_ty), mask=ok)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes these: one shape, dtype (bf16) and device, both contiguous."""
    return (
        gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in DTYPES
        and gate.device == up.device
        and gate.is_contiguous()
        and up.is_contiguous()
        and gate.numel() > 0
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` as the eager ops round it (see the module's docstring); see supports."""
    out = torch.empty_like(gate)
    n = gate.numel()
    with triton_launch_device(gate.device):
        _silu_mul_kernel[(triton.cdiv(n, _BLOCK),)](
            gate, up, out, n, BLOCK=_BLOCK, MATH_LIBRARY=not INTERPRETED, num_warps=8
        )
    return out
