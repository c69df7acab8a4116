"""Where a slot decoder's work runs on the device: its decode steps and its prefills, in order on
one stream, or side by side on two.

Side by side (CUDA): the decode steps on a stream of high priority, the prefills on a stream of
their own. A decode step at a few hundred slots is half attention, bound by reading the cache,
and a prefill is mostly GEMMs, bound by the tensor cores, so a prefill issued beside the decode
steps runs in what they leave of the device instead of stopping every slot while it runs; the
priority keeps the slots already decoding ahead of it where both wait for the same
multiprocessors. The decoder makes the two independent (decode.SlotDecoder parks the slots being
prefilled where no prefill writes), and takes a prefill's first tokens into the step's inputs only
once its event says it is done (`join`).

In order (the CPU, or CUDA without a recorded step): no streams, no events; `ready` is always
true. A decoder may still hold a finished prefill back for a step (`overlap` on a CPU), so that
the tests run the same schedule the device runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# stream priorities (lower is higher)
_DECODE_PRIORITY = -1
_PREFILL_PRIORITY = 0


class Lanes:
    def __init__(self, device: torch.device, side_by_side: bool):
        self.device = device
        streams = side_by_side and device.type == "cuda"
        self._decode = torch.cuda.Stream(device, priority=_DECODE_PRIORITY) if streams else None
        self._prefill = torch.cuda.Stream(device, priority=_PREFILL_PRIORITY) if streams else None

    @property
    def streams(self) -> bool:
        return self._decode is not None

    def begin(self) -> None:
        """Both lanes start after what the caller's stream has queued (the weights' refresh, the
        sampling settings)."""
        if self._decode is not None and self._prefill is not None:
            current = torch.cuda.current_stream(self.device)
            self._decode.wait_stream(current)
            self._prefill.wait_stream(current)

    def end(self) -> None:
        """The caller's stream continues after both lanes (a generate that ends, or is closed)."""
        if self._decode is not None and self._prefill is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._decode)
            current.wait_stream(self._prefill)

    def decode(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._decode) if self._decode is not None else contextlib.nullcontext()

    def prefill(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._prefill) if self._prefill is not None else contextlib.nullcontext()

    def mark(self) -> Any:
        """An event after the work queued on the prefill lane so far (None in order)."""
        if self._prefill is None:
            return None
        event = torch.cuda.Event()
        event.record(self._prefill)
        return event

    @staticmethod
    def ready(event: Any) -> bool:
        return event is None or bool(event.query())

    def join(self, event: Any, *tensors: torch.Tensor) -> None:
        """The decode lane continues after `event`, and reads `tensors` (made on the prefill
        lane) with the allocator told so, so their memory is not reused under its reads."""
        if event is None or self._decode is None:
            return
        self._decode.wait_event(event)
        for t in tensors:
            t.record_stream(self._decode)
