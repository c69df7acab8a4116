"""Which accelerators this host has, for callers that must not import torch themselves."""
from __future__ import annotations

import torch


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA); reads the driver, creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_devices() -> tuple[list[str], list[str]]:
    """(target_devices, drafter_devices) for the embedded default on this host: everything on
    cuda:0 with one GPU, the drafter on cuda:1 with two or more, else the CPU."""
    n = cuda_device_count()
    if n == 0:
        return ["cpu"], ["cpu"]
    if n == 1:
        return ["cuda:0"], ["cuda:0"]
    return ["cuda:0"], ["cuda:1"]


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The precision models run in on a device: bf16 on CUDA, fp32 elsewhere (CPU bf16 is slow
    and the CPU path exists for tests and the demo)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
