"""Which FP8 format the gradients of the FP8 step take (CPU, a few seconds).

    python -m bench.fp8_formats

The relative error (Frobenius norm) of the gradients the FP8 step computes, e5m2 against e4m3,
each with the step's own scaling:
- the linear layers' input and weight gradients (dflash_core.fp8's autograd Function, one amax
  scale per tensor), for Gaussian output gradients and for heavy-tailed ones (log-normal spread);
- the lm_head's hidden-state gradient (softmax - onehot) * w @ W with the loss kernel's fixed
  scale (largest row weight -> the format's largest value), for a peaked and a near-uniform
  softmax over a 152k vocabulary.
"""

from __future__ import annotations

import json

import torch

import dflash_core.fp8 as fp8

FORMATS = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm()), 4)


def linear_errors(dtype: torch.dtype, heavy: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(256, 512, generator=g) * 0.02).bfloat16().requires_grad_()
    grad = torch.randn(256, 256, generator=g)
    if heavy:
        grad = grad * torch.exp(torch.randn(256, 256, generator=g) * 2)
    saved, fp8.GRAD_DTYPE = fp8.GRAD_DTYPE, dtype
    try:
        fp8._Fp8Linear.apply(x, w).backward(grad.bfloat16())
    finally:
        fp8.GRAD_DTYPE = saved
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (x32 @ w32.t()).backward(grad.bfloat16().float())
    return {"grad_input": _rel(x.grad, x32.grad), "grad_weight": _rel(w.grad, w32.grad)}


def lm_head_error(dtype: torch.dtype, temperature: float, vocab: int = 151936) -> float:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, 128, generator=g) * 0.02
    h = torch.randn(64, 128, generator=g) * temperature
    p = (h @ w.t() * 10).softmax(-1)
    labels = torch.randint(0, vocab, (64,), generator=g)
    rows = torch.rand(64, generator=g)
    grad = (p - torch.nn.functional.one_hot(labels, vocab).float()) * rows[:, None]
    scale = torch.finfo(dtype).max / rows.max()
    quantized = (grad * scale).to(dtype).float() / scale
    return _rel(quantized @ w, grad @ w)


def main() -> None:
    for name, dtype in FORMATS.items():
        row = {
            "format": name,
            "linear_gaussian": linear_errors(dtype, heavy=False),
            "linear_heavy_tailed": linear_errors(dtype, heavy=True),
            "lm_head_peaked": lm_head_error(dtype, 3.0),
            "lm_head_near_uniform": lm_head_error(dtype, 0.1),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
