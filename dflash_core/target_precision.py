"""The target run in FP8 (`[engine] target_precision = "fp8"`): a bf16 target's decoder linears
quantized once at load, so the drafter trains on the features of an FP8-served target.

The scheme is the one serving engines apply to a bf16 checkpoint they are asked to serve in FP8
(vLLM's online `--quantization fp8`): e4m3 weights with one scale per matrix, and activations
cast per call with one dynamic scale per tensor, the GEMM a cuBLAS FP8 GEMM (`torch._scaled_mm`)
that returns the activations' dtype. The embedding, the final norm and the LM head stay as they
are (the drafter's frozen head reads them). The features differ from the bf16 target's by FP8's
rounding: that is the point, and the reason it is a setting and never a default.

A checkpoint stored in FP8 (a `quantization_config` with quant_method "fp8") needs none of this:
transformers loads it as stored and "as_loaded" runs it so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FORWARD_DTYPE, FP8_MULTIPLE, quantize


class Fp8FrozenLinear(nn.Module):
    """A frozen nn.Linear as an FP8 GEMM: the weight quantized once (buffers, no parameters)."""

    weight8: torch.Tensor
    weight_inv_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight8, inv = quantize(linear.weight.detach(), FORWARD_DTYPE)
        self.register_buffer("weight8", weight8)
        self.register_buffer("weight_inv_scale", inv)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = -rows % FP8_MULTIPLE  # FP8 GEMMs take rows in multiples of 16: zero rows, dropped after
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        x8, x_inv = quantize(x2, FORWARD_DTYPE)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        out = torch._scaled_mm(
            x8, self.weight8.t(), scale_a=x_inv, scale_b=self.weight_inv_scale, bias=bias, out_dtype=x.dtype
        )
        return out[:rows].view(*x.shape[:-1], self.out_features)


def fp8_convertible(linear: nn.Linear) -> bool:
    return linear.in_features % FP8_MULTIPLE == 0 and linear.out_features % FP8_MULTIPLE == 0


@torch.no_grad()
def quantize_decoder_linears(layers: nn.ModuleList) -> int:
    """Replaces every nn.Linear inside the decoder layers (whose widths FP8 takes) by an
    Fp8FrozenLinear on the same device, freeing its bf16 weight; how many."""
    count = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and fp8_convertible(child):
                    setattr(parent, name, Fp8FrozenLinear(child))
                    count += 1
    return count
