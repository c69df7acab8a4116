"""A replica's checkpoint state copied into host buffers (pinned where the state lives on a GPU)
that every checkpoint reuses, and the preparation of those buffers ahead of the first one."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .replica import DrafterReplica

log = logging.getLogger("dflash.engine")

SLAB_BYTES = 256 << 20  # the smallest pinned allocation the buffers are carved from
ALIGN = 4096  # each buffer starts on a page of its slab


class HostSnapshot:
    """Host buffers for a replica's checkpoint state, reused from one checkpoint to the next, and
    the copy of the state into them.

    Device tensors are copied into pinned buffers matched by shape and dtype, in the order the
    state lists them, so a checkpoint copies into the buffers of the one before. They can be
    prepared ahead, in a background thread, from the shapes the state will have (pinned
    allocation takes seconds for a large drafter); a tensor with no buffer of its shape gets one
    when it is first copied. Host tensors (step counters, small) are cloned.

    Page-locking gigabytes slows every CUDA call other threads make meanwhile (kernel loads and
    launches included), so the engine prepares them once it is ready, not while it compiles, and
    a job that starts while they are still being pinned holds the preparation (hold / release)
    through its start and first step. The pinned buffers are carved out of a few slabs (PinnedSlabs
    says why)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._slabs = PinnedSlabs()
        # guards the preparing thread, the hold and the joins: a job's checkpoint, the job's hold
        # and the engine's close may reach it from different threads
        self._cond = threading.Condition()
        self._preparing: threading.Thread | None = None
        self._held = False
        self._joining = 0  # threads waiting for the preparation to end: they override a hold
        self._cancel = threading.Event()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.state = "empty"  # empty | pinning | pinned | failed: what /healthz reports

    def prepare(
        self, likes: Iterable[tuple[torch.Size, torch.dtype, torch.device]], done: Callable[[], None] | None = None
    ) -> None:
        """Allocate buffers for the device tensors of these shapes in a background thread; done()
        there once they all are (not when clear() cut it short)."""
        self._join()  # one preparation at a time
        cancel = self._cancel

        def may_go() -> bool:
            return not self._held or self._joining > 0 or cancel.is_set()

        def run() -> None:
            try:
                for shape, dtype, device in likes:
                    with self._cond:
                        self._cond.wait_for(may_go)
                    if cancel.is_set():
                        return
                    if torch.device(device).type == "cuda":
                        key = (tuple(shape), dtype)
                        self._buffers.setdefault(key, []).append(self._slabs.take(shape, dtype))
            except (RuntimeError, MemoryError) as e:  # the host cannot pin that much: said, not raised away
                # the first checkpoint allocates what is missing itself and fails the job there if it must
                self.state = "failed"
                log.warning("checkpoint buffers not pinned ahead: %s", e, extra={"fields": {"error": str(e)[:500]}})
                return
            self.state = "pinned"
            if done is not None:
                done()

        thread = threading.Thread(target=run, name="checkpoint-buffers", daemon=True)
        with self._cond:
            self._preparing = thread
            self.state = "pinning"
        thread.start()

    def hold(self) -> None:
        """Pause a preparation (in flight or to come) before its next buffer, the one it is
        allocating being completed, until release(); anyone waiting for the buffers (wait, copy,
        clear) lets it go on meanwhile."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def _join(self) -> None:
        with self._cond:
            thread = self._preparing
            if thread is None:
                return
            self._joining += 1
            self._cond.notify_all()
        try:
            thread.join()
        finally:
            with self._cond:
                self._joining -= 1
                if self._preparing is thread:
                    self._preparing = None

    def wait(self) -> None:
        """Until the buffers `prepare` started are allocated."""
        self._join()

    def copy(self, state: Any) -> tuple[Any, torch.cuda.Event | None]:
        """(the state with every tensor replaced by its host copy, an event the copies of device
        tensors complete at, or None when everything was copied synchronously)."""
        self._join()
        tensors: list[torch.Tensor] = []
        _collect(state, tensors)
        event = None
        copies: list[torch.Tensor] = []
        used: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for t in tensors:
            if t.device.type != "cuda":
                copies.append(t.detach().clone())
                continue
            key = (tuple(t.shape), t.dtype)
            pool = self._buffers.setdefault(key, [])
            n = used[key] = used.get(key, 0) + 1
            if len(pool) < n:
                pool.append(self._slabs.take(t.shape, t.dtype))
            buf = pool[n - 1]
            copies.append(buf)
            by_device.setdefault(t.device, []).append((buf, t))
        for device, pairs in by_device.items():
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for buf, t in pairs:
                    buf.copy_(t.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        return _rebuild(state, iter(copies)), event

    def clear(self) -> None:
        """Drop the buffers; a preparation in flight stops after the buffer it is allocating."""
        with self._cond:
            self._cancel.set()
            self._cond.notify_all()
        self._join()
        self._buffers = {}
        self._slabs = PinnedSlabs()
        self._cancel = threading.Event()
        self.state = "empty"

    @property
    def pinned_bytes(self) -> int:
        """Host memory the buffers hold pinned (their slabs)."""
        return self._slabs.nbytes


class PinnedSlabs:
    """Host buffers carved out of few large allocations whose sizes are powers of two.

    torch's pinned-memory allocator rounds every allocation up to a power of two, so buffers
    of a drafter's matrices (a 192 MiB MLP weight takes 256 MiB) would pin about a quarter more
    host memory than they hold, and take as much longer to pin. Here each buffer takes the first
    slab with room for it (else a new one, twice the last up to SLAB_BYTES, or the power of two
    that holds it), and is a tensor with
    a storage of its own over its slab's bytes (torch.frombuffer), so that safetensors and
    torch.save see separate tensors of their exact sizes. A buffer keeps its slab alive.

    pin=False: the same carving from pageable memory (what a host without CUDA can test)."""

    def __init__(self, pin: bool = True, slab_bytes: int = SLAB_BYTES):
        self.pin = pin
        self.slab_bytes = slab_bytes
        self._slabs: list[tuple[Any, list[int]]] = []  # (the slab's bytes as an array, [bytes used])

    @property
    def nbytes(self) -> int:
        return sum(len(raw) for raw, _ in self._slabs)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        need = -(-numel * dtype.itemsize // ALIGN) * ALIGN
        for raw, used in self._slabs:
            if used[0] + need <= len(raw):
                break
        else:
            # slabs double up to slab_bytes: a small state pins little more than it holds
            last = len(self._slabs[-1][0]) if self._slabs else 0
            size = max(1 << (need - 1).bit_length(), min(self.slab_bytes, 2 * last))
            # the array holds the slab tensor; frombuffer's tensors hold the array
            raw, used = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin).numpy(), [0]
            self._slabs.append((raw, used))
        offset, used[0] = used[0], used[0] + need
        return torch.frombuffer(raw, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, buffers) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(buffers)
    if isinstance(obj, dict):
        return {k: _rebuild(v, buffers) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_rebuild(v, buffers) for v in obj)
    return obj


def expected_layout(rep: DrafterReplica) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    """The tensors a checkpoint of this replica copies, in HostSnapshot's order, before the
    optimizer has created its state: the masters, then AdamW's two moments per master (its
    step counters live on the host and need no buffer)."""
    masters = [m for _, m in rep.named_masters()]
    likes = [(m.shape, m.dtype, m.device) for m in masters]
    for m in masters:
        likes += [(m.shape, torch.float32, m.device)] * 2
    return likes
