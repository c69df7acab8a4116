"""Fixed receive buffers for the target's hidden states on a drafter's device.

The target workers hand every micro-batch's features to a drafter thread. Copied with
`feats.to(drafter_device)`, each hand-over allocated ~126 MB (S=3072, five 4096-wide layers,
bf16) on the drafter's device from the target's thread, at moments set by how far ahead the
target runs. Those allocations interleave with the drafter's own at varying points of its step,
so the caching allocator sometimes split a large free block (the loss chunk's logits) for them
and had to reserve a new segment later: reserved memory grew by one logits buffer (0.545 GiB,
2.7 %) during a 100-step job on the H200 (run P). Here the buffers are allocated once per job;
a worker copies into a free one and the drafter gives it back after its micro-step. What the
worker still allocates on the drafter's device is the micro-batch's token ids and positions
(a few KiB, the allocator's small pool); a target on the drafter's own GPU allocates its
activations there anyway, and pays one extra device copy of the features per micro-batch.

Reuse is ordered by the device: the drafter releases a slot after its forward and backward are
queued, and a cross-device copy into the slot waits for the work queued on the destination's
current stream (PyTorch's two-way barrier); a same-device copy runs on that stream itself.
"""
from __future__ import annotations

import queue
import threading

import torch


class FeatureSlots:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int):
        self.buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def fill(self, features: torch.Tensor, stop: threading.Event) -> int | None:
        """Copy `features` into a free slot (waiting for one); its index, or None once `stop` is set."""
        while not stop.is_set():
            try:
                slot = self._free.get(timeout=0.2)
            except queue.Empty:
                continue
            self.buffers[slot].copy_(features, non_blocking=True)
            return slot
        return None

    def release(self, slot: int) -> None:
        self._free.put(slot)
