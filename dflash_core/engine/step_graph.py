"""A drafter replica's micro-step (forward, loss, backward) recorded as one CUDA graph.

Why: even compiled, one micro-step launches hundreds of kernels from Python: the compiled
layers' wrappers, flex_attention's, the BlockMask's small ops, the loss chunks, and the
backward on autograd's device thread. Every launch holds the GIL, and one process drives every
GPU of a host from threads, so that host time bounds how many pipelines a process can run.
Replaying the graph costs the host a few copies into fixed input buffers and one launch.

What the graph holds: `micro_step` on fixed input buffers (the micro-batch's tensors, the target
features, the loss scale and the position decay, so one graph serves any job's gradient
accumulation and gamma; in the objective step also the replica's ObjectiveInputs: mix weights,
D-PACE switch and alpha, written in place per job), its backward, and the per-block statistics the step's accumulator sums.
The parameters' gradients are buffers of the graph: each replay overwrites them with that
micro-batch's gradient (the replica sums them itself when a step has several micro-batches).

Rules the recording relies on: shapes are fixed (the engine's production shape; other shapes run
eagerly); nothing in the step waits for the host; the recording thread is the only one working
on the device (the engine records during warm-up, in its main thread, before any worker
exists); autocast's cast cache is off inside the graph (cached casts would be freed with the
autocast region yet replayed). The engine keeps a graph only when its replay reproduces the
eager step bit for bit (`matches_eager`).
"""

from __future__ import annotations

import logging

import torch

from ..data.batches import MicroBatch
from ..step.blocks import position_decay

log = logging.getLogger("dflash.engine")
_BATCH_FIELDS = ("input_ids", "position_ids", "doc_ids", "loss_mask", "anchors", "anchor_valid")


class StepGraph:
    def __init__(self, rep, batch: MicroBatch, features: torch.Tensor):
        """Record `rep`'s micro-step at the shapes of `batch` and `features` (on rep.device).
        Leaves rep's gradients unset; raises what the recording raised (the caller falls back to
        the eager step)."""
        dev = rep.device
        self.device = dev
        self.batch = MicroBatch(*(getattr(batch, f).to(dev).clone() for f in _BATCH_FIELDS))
        self.features = features.to(dev).clone()
        self.scale = torch.ones((), dtype=torch.float32, device=dev)
        self._scale_value = 1.0
        self.gamma = float(rep.gamma)
        self.layout = rep.config.block_layout
        self.decay = position_decay(rep.config.block_size, self.gamma, dev, self.layout)
        current = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # lazy initialisations (handles, workspaces) outside the graph
            self._run(rep)
        current.wait_stream(side)
        rep.zero_grad()  # unset: the backward inside the graph allocates them in the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            # the device's own capture stream, and the device current: torch's default capture
            # stream belongs to whichever device was current when the first graph was recorded
            with (
                torch.cuda.device(dev),
                torch.cuda.graph(graph, stream=torch.cuda.Stream(dev), capture_error_mode="thread_local"),
            ):
                self.loss, self.correct, self.counted = self._run(rep)
        finally:
            self.grads: list[torch.Tensor] = [p.grad for p in rep.params]
            rep.zero_grad()
        if any(g is None for g in self.grads):
            raise RuntimeError("the recorded backward left a parameter without a gradient")
        self.graph = graph
        torch.cuda.synchronize(dev)

    def _run(self, rep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, stats = rep.loss_and_backward(self.batch, self.features, self.scale, decay=self.decay, cast_cache=False)
        return stats

    def fits(self, batch: MicroBatch, features: torch.Tensor) -> bool:
        """Whether this micro-batch has the recorded shapes (else it runs eagerly)."""
        return (
            features.shape == self.features.shape
            and features.dtype == self.features.dtype
            and all(getattr(batch, f).shape == getattr(self.batch, f).shape for f in _BATCH_FIELDS)
        )

    def replay(self, batch: MicroBatch, features: torch.Tensor, loss_scale: float, gamma: float) -> None:
        """One micro-step on this micro-batch: copies into the input buffers (ordered on the
        current stream, like the replay) and the graph. Overwrites self.grads, loss, correct, counted."""
        for f in _BATCH_FIELDS:
            getattr(self.batch, f).copy_(getattr(batch, f), non_blocking=True)
        self.features.copy_(features, non_blocking=True)
        if loss_scale != self._scale_value:
            self.scale.fill_(loss_scale)
            self._scale_value = loss_scale
        if gamma != self.gamma:
            self.decay.copy_(position_decay(self.decay.shape[0], gamma, self.device, self.layout))
            self.gamma = gamma
        self.graph.replay()


@torch.no_grad()
def matches_eager(graph: StepGraph, rep, batch: MicroBatch, features: torch.Tensor) -> bool:
    """Replay against the eager step on one micro-batch: the same loss, statistics and
    gradients, bit for bit (rep's gradients are left unset). Give it another micro-batch than
    the recorded one: a graph that recorded nothing would still hold the recorded batch's
    gradients and pass on that one."""
    with torch.enable_grad():
        rep.zero_grad()
        acc = rep.new_accumulator()
        rep.forward_backward(batch, features, 1.0, acc, graphed=False)
    eager = [p.grad.clone() for p in rep.params]
    rep.zero_grad()
    with torch.cuda.device(graph.device):
        graph.replay(batch, features, 1.0, float(rep.gamma))
    same = (
        torch.equal(graph.loss, acc.loss_sum)
        and torch.equal(graph.correct, acc.correct)
        and torch.equal(graph.counted, acc.counted)
        and all(torch.equal(a, b) for a, b in zip(eager, graph.grads, strict=True))
    )
    return bool(same)


def record_step_graph(rep, batch: MicroBatch, features: torch.Tensor, check: MicroBatch) -> bool:
    """Record the replica's micro-step as a graph on `batch` and keep it (as rep.step_graph) only
    if its replay of another micro-batch (`check`, with the features shifted) gives the eager
    step's loss, statistics and gradients bit for bit; whether it was kept. CUDA with bf16
    working weights only (the engine's CUDA plan); elsewhere the step stays eager."""
    if rep.device.type != "cuda" or rep.working_weights != "bf16":
        return False
    feats, mb = features.to(rep.device), batch.to(rep.device)
    try:
        graph = StepGraph(rep, mb, feats)
        kept = matches_eager(graph, rep, check.to(rep.device), torch.roll(feats, 1, 0))
    except RuntimeError as e:  # torch.OutOfMemoryError too: the graph's memory pool did not fit
        rep.zero_grad()
        torch.cuda.synchronize(rep.device)
        log.warning(
            "the drafter step could not be recorded as a CUDA graph; stepping eagerly",
            extra={"fields": {"device": str(rep.device), "error": f"{type(e).__name__}: {e}"}},
        )
        return False
    rep.zero_grad()
    if kept:
        rep.step_graph = graph
        return True
    del graph
    log.warning(
        "the drafter step's CUDA graph does not reproduce its eager step; stepping eagerly",
        extra={"fields": {"device": str(rep.device)}},
    )
    return False
