"""The feature pipeline of one job: target threads capture hidden states and hand them to the
drafter threads through bounded queues and preallocated receive buffers.

Micro-batch g of the job goes to replica (g mod R*A) // A (R replicas, A micro-batches of
gradient accumulation per step). In a group of H ranks (hosts) a step takes H*R*A micro-batches:
rank h trains those with (g mod H*R*A) // (R*A) == h, so the ranks read disjoint shares and
together the same micro-batches one process with H*R replicas would. With W target copies, target worker w feeds the replicas r with
r mod W == w, each replica by one worker and in order, so results do not depend on W.

Receive buffers (`FeatureSlots`). Copied with `feats.to(drafter_device)`, every hand-over would
allocate a feature-sized tensor on the drafter's device from the target's thread, at moments set
by how far ahead the target runs. Those allocations interleave with the drafter's own at varying
points of its step, so the caching allocator would sometimes split a large free block for them
and reserve a new segment later: reserved memory would creep during a job. The buffers are
allocated once per job instead; a worker copies into a free one and the drafter gives it back
after its micro-step. Reuse is ordered by the device: the drafter releases a slot after its
forward and backward are queued, and a copy into the slot waits for the work queued on the
destination's current stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..data.batches import BatchSource, MicroBatch
from ..target import TargetModel
from .api import JobError

QUEUE_DEPTH = 4  # micro-batches waiting per drafter: enough to hide the target's jitter
_POLL = 0.2  # seconds between checks of the stop flag while waiting


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
                slot = self._free.get(timeout=_POLL)
            except queue.Empty:
                continue
            self.buffers[slot].copy_(features, non_blocking=True)
            return slot
        return None

    def release(self, slot: int) -> None:
        self._free.put(slot)


@dataclass
class Delivery:
    """One micro-batch on its drafter's device, with its target features."""

    batch: MicroBatch
    features: torch.Tensor
    context_tokens: int
    _slots: FeatureSlots
    _slot: int

    def release(self) -> None:
        """Give the features' buffer back (after the micro-step's work is queued)."""
        self._slots.release(self._slot)


@dataclass(frozen=True)
class Span:
    """The micro-batches a pipeline feeds: [first, end) of the job's, `grad_accum` per replica
    and step, and of each step's `per_step` (over every rank) those of this process's `rank`
    (one process: rank 0, and all of them)."""

    first: int
    end: int
    grad_accum: int
    rank: int = 0
    per_step: int = 1


def capture(target: TargetModel, mb: MicroBatch) -> torch.Tensor:
    dev = target.device
    return target.capture(mb.input_ids.to(dev), mb.position_ids.to(dev), mb.doc_ids.to(dev))


class FeaturePipeline:
    """Target worker threads feeding one bounded queue per drafter replica, for the micro-batches
    of `stream` in `span`. `get(r)` is called by replica r's thread; `close()` stops and joins
    the workers and drops the buffers. A worker's failure reaches the drafters as a JobError."""

    def __init__(
        self,
        targets: list[TargetModel],
        drafter_devices: list[torch.device],
        stream: BatchSource,
        span: Span,
        *,
        feature_spec: tuple[tuple[int, ...], torch.dtype],
        on_thread: Callable[[str], None] = lambda name: None,
    ):
        self.devices = drafter_devices
        self.rank, self.per_step = span.rank, span.per_step
        self.stream = stream
        self.first, self.end, self.accum = span.first, span.end, span.grad_accum
        self.queues: list[queue.Queue[Delivery]] = [queue.Queue(maxsize=QUEUE_DEPTH) for _ in drafter_devices]
        # one slot per queued micro-batch, one in the drafter's hands, one being filled
        self.slots = [FeatureSlots(*feature_spec, dev, QUEUE_DEPTH + 2) for dev in drafter_devices]
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._workers = [
            threading.Thread(target=self._produce, args=(w, target), name=f"target-{w}-{target.device}", daemon=True)
            for w, target in enumerate(targets[: len(drafter_devices)])
        ]
        self._on_thread = on_thread
        self._depths: dict[str, int] = {}

    @staticmethod
    def queue_name(index: int, device: torch.device) -> str:
        return f"drafter-{index}-{device}"

    def start(self) -> FeaturePipeline:
        for worker in self._workers:
            self._on_thread(worker.name)
            worker.start()
        return self

    def depths(self) -> dict[str, int]:
        """Micro-batches waiting per drafter queue, as last seen by the threads."""
        return dict(self._depths)

    def _note_depth(self, r: int) -> None:
        self._depths[self.queue_name(r, self.devices[r])] = self.queues[r].qsize()

    def _produce(self, worker: int, target: TargetModel) -> None:
        workers = len(self._workers)
        local, per_step = len(self.queues) * self.accum, self.per_step
        try:
            if target.device.type == "cuda":
                torch.cuda.set_device(target.device)
            for g in range(self.first, self.end):
                if (g % per_step) // local != self.rank:
                    continue
                r = (g % local) // self.accum
                if r % workers != worker:
                    continue
                if self.stop.is_set():
                    return
                mb = self.stream.get(g)
                if target.device.type == "cuda":
                    mb = mb.pin_memory()
                slot = self.slots[r].fill(capture(target, mb), self.stop)
                if slot is None:
                    return
                item = Delivery(
                    mb.to(self.devices[r], non_blocking=True),
                    self.slots[r].buffers[slot],
                    mb.context_tokens,
                    self.slots[r],
                    slot,
                )
                while not self.stop.is_set():
                    try:
                        self.queues[r].put(item, timeout=_POLL)
                        break
                    except queue.Full:
                        continue
                self._note_depth(r)
        except BaseException as e:  # noqa: BLE001 - the drafter threads raise it and fail the job
            self.error = e
            self.stop.set()

    def get(self, r: int) -> Delivery:
        """Replica r's next micro-batch (waits for it); raises JobError when the pipeline failed."""
        while True:
            try:
                item = self.queues[r].get(timeout=_POLL)
                break
            except queue.Empty:
                if self.error is not None:
                    err = self.error
                    raise JobError(f"target worker failed: {type(err).__name__}: {err}") from err
                if self.stop.is_set():
                    raise JobError("the job's pipeline stopped") from None
        self._note_depth(r)
        return item

    def close(self, timeout: float = 60.0) -> None:
        self.stop.set()
        for q in self.queues:  # unblocks a worker waiting to put
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for worker in self._workers:
            if worker.ident is not None:  # started
                worker.join(timeout=timeout)
        for slots in self.slots:  # a failed job's traceback keeps this object alive: not its buffers
            slots.buffers.clear()
        self._depths.clear()
