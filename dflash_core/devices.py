"""Which accelerators this host has, for callers that must not import torch themselves."""

from __future__ import annotations

import contextlib
import threading

import torch


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA); reads the driver, creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def usable_device(name: str) -> torch.device:
    """`name` as a device this process can run on (cpu, cuda, cuda:N); a ValueError naming it
    where it is no device name, or names a device this host does not have."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r}: not a device name (cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r}: only cpu and cuda devices are supported")
    count = cuda_device_count()
    if count == 0:
        raise ValueError(f"device {name!r}: this host has no CUDA device")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {name!r}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


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


class CudaContexts:
    """Creates the CUDA context of each device in a side thread, so the seconds the driver takes
    per device overlap the build's imports (transformers, Python-bound) instead of adding to the
    time to ready. Tensor creation releases the GIL, so the two really run side by side.
    `wait()` returns once every context exists, re-raising what the thread hit."""

    def __init__(self, devices: list[str]):
        self.devices = sorted({str(torch.device(d)) for d in devices if torch.device(d).type == "cuda"})
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._create, name="cuda-contexts", daemon=True)
        if self.devices:
            self._thread.start()

    def _create(self) -> None:
        try:
            for device in self.devices:
                torch.empty(1, device=device)  # the context and the caching allocator of the device
        except BaseException as e:  # noqa: BLE001 - handed to the build thread by wait()
            self.error = e

    def wait(self, timeout: float = 300.0) -> None:
        if self.devices:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(
                    f"creating the CUDA contexts of {', '.join(self.devices)} took over {timeout:.0f} s: "
                    "is a GPU hung or held by another process? (nvidia-smi)"
                )
        if self.error is not None:
            raise self.error


def triton_launch_device(device: torch.device):
    """Context for a Triton launch on `device`: Triton launches on the thread's current CUDA
    device, not on its tensors'; Triton's interpreter (TRITON_INTERPRET=1, CPU tests) needs none."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
