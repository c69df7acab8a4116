"""The Triton FP8 cast (dflash_core/kernels/fp8_cast.py) against fp8.quantize on zero-padded input.

Runs on CUDA (tests/gpu, every value bit for bit) and, through Triton's interpreter, on CPU:
`TRITON_INTERPRET=1 python -m tests.fp8_cast_check` (a separate process: the flag is read when the
kernel module is imported); prints one JSON object: compare's keys, and nonfinite's under
"nonfinite".
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

SHAPES = ((37, 64), (48, 128), (1, 16), (3000, 96), (4099, 4096))


def compare(device: str = "cpu", shapes=SHAPES) -> dict:
    from dflash_core.fp8 import FORWARD_DTYPE, quantize
    from dflash_core.kernels.fp8_cast import quantize_rows

    g = torch.Generator().manual_seed(0)
    result = {"inv_equal": True, "pad_zero": True, "in_range": True, "shape_ok": True, "value_mismatches": 0}
    for rows, cols in shapes:
        x = (torch.randn(rows, cols, generator=g) * 3).bfloat16().to(device)
        padded = rows + (-rows % 16)
        a8, a_inv = quantize_rows(x, FORWARD_DTYPE, padded)
        b8, b_inv = quantize(F.pad(x, (0, 0, 0, padded - rows)), FORWARD_DTYPE)
        a = a8.float().cpu()
        result["shape_ok"] &= a8.shape == (padded, cols) and a8.dtype == FORWARD_DTYPE
        result["inv_equal"] &= bool(torch.equal(a_inv.cpu(), b_inv.cpu()))
        result["pad_zero"] &= bool((a[rows:] == 0).all())
        result["in_range"] &= bool(a.abs().max() <= torch.finfo(FORWARD_DTYPE).max)
        result["value_mismatches"] += int((a8.view(torch.uint8) != b8.view(torch.uint8)).sum())
    return result


def nonfinite(device: str = "cpu") -> dict:
    """A NaN or an infinity in the tensor: its inverse scale is infinite (so every product of the
    GEMM is NaN, as with fp8.quantize, whose scale is NaN); a NaN value stays NaN in FP8."""
    from dflash_core.fp8 import FORWARD_DTYPE
    from dflash_core.kernels.fp8_cast import quantize_rows

    out = {}
    for name, bad in (("nan", float("nan")), ("inf", float("inf"))):
        x = torch.randn(32, 64).bfloat16().to(device)
        x[3, 5] = bad
        x8, inv = quantize_rows(x, FORWARD_DTYPE, 32)
        out[f"{name}_inv_inf"] = bool(torch.isinf(inv).item())
        out[f"{name}_value_nan"] = bool(torch.isnan(x8[3, 5].float()).item())
    return out


def main(flags: list[str]) -> dict:
    """The CPU check's result: the first four shapes (the last is long in the interpreter)."""
    return {**compare(shapes=SHAPES[:4]), "nonfinite": nonfinite()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
