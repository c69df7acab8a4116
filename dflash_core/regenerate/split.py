"""The decode step in two halves of the slots on two CUDA streams, so that one half's attention
(bound by the cache's bytes) runs while the other half's projections and MLP (bound by the tensor
cores at a few hundred rows) do.

One stream runs every layer for the first half, then the logits and the choice of its tokens; the
other does the same for the second half, over its own view of the cache (SlotCache.part). The
halves share nothing but the weights, so inside a recorded graph they are two independent
branches the GPU may interleave. The second half starts once the first has finished its first
layer's attention block: the two are then out of phase by about that block, so that where one is
in its attention the other is in its GEMMs, rather than both reading the cache at once.

Each half's tokens are chosen from its own rows exactly as a whole step chooses them (the noise
depends on a sequence's seed and step alone), so the split changes which GEMM shapes run, never
what is computed per row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .cache import SlotCache


def halves(slots: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two row ranges [start, end) of a split step."""
    if slots < 2:
        raise ValueError(f"a split decode step needs at least 2 slots, not {slots}")
    mid = slots // 2
    return (0, mid), (mid, slots)


def phase_marker(decoder) -> torch.nn.Module | None:
    """The module after whose forward the second half starts: the first decoder layer's attention
    block (its projections, its attention and its output projection), where the family names it
    `self_attn` as transformers' decoders do; None where it has none (the halves then start
    together)."""
    layers = getattr(decoder, "layers", None)
    if not layers:
        return None
    marker = getattr(layers[0], "self_attn", None)
    return marker if isinstance(marker, torch.nn.Module) else None


class SplitStep:
    """Runs `rows(start, end, cache)` for the two halves of a decoder's slots: on CUDA the second
    on a stream of its own, joined back before the step's shared updates; elsewhere one after
    the other (the same arithmetic, what the CPU tests compare)."""

    def __init__(self, cache: SlotCache, slots: int, decoder, device: torch.device):
        self.ranges = halves(slots)
        self.parts = [cache.part(a, b) for a, b in self.ranges]
        self.marker = phase_marker(decoder)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    def __call__(self, rows: Callable[[int, int, SlotCache], None], write_kernel: bool) -> None:
        for part in self.parts:  # the decoder's own cache may have been told otherwise since
            part.write_kernel = write_kernel
        (a0, a1), (b0, b1) = self.ranges
        first, second = self.parts
        if self.stream is None:
            rows(a0, a1, first)
            rows(b0, b1, second)
            return
        main = torch.cuda.current_stream(self.device)
        started = torch.cuda.Event()
        fired = self._run_marked(lambda: rows(a0, a1, first), started, main)
        if fired:
            self.stream.wait_event(started)
        else:
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            rows(b0, b1, second)
        main.wait_stream(self.stream)

    def _run_marked(self, run: Callable[[], None], event: torch.cuda.Event, stream) -> bool:
        """run() with `event` recorded on `stream` when the marker's first forward in this
        thread returns; whether it was."""
        if self.marker is None:
            run()
            return False
        owner, fired = threading.get_ident(), list[bool]()

        def mark(module, args, output):
            # only this thread's first call: another user of the target in another thread is
            # not part of this step
            if threading.get_ident() == owner and not fired:
                event.record(stream)
                fired.append(True)

        handle = self.marker.register_forward_hook(mark)
        try:
            run()
        finally:
            handle.remove()
        return bool(fired)
