"""The target's decoder layers compiled for its recorded capture (TargetModel.record_graph).

Between its GEMMs a transformers decoder layer runs as eager code: RMSNorm in fp32, RoPE, the
SwiGLU product, residual adds and copies, each its own kernel that reads and writes the whole
activation. Inside the recorded CUDA graph the launches cost nothing, but the memory traffic
stays; compiled, inductor fuses those pointwise and reduction ops between the GEMMs.

One compiled function serves every layer of a family (parameters are graph inputs, as the
drafter's `run_layer`), so a cold start compiles one layer's graph, not the stack's. The
compiled forward runs only while the capture is recorded: its replays run the recorded kernels
and never enter Python, and a capture at any other length (or with the graph dropped) runs the
eager layers, so nothing compiles after warm-up. An FP8 target's linears are traced into the
compiled graph with their input casts (target_precision.Fp8FrozenLinear), so a layer is one
graph, its casts fused into the kernels that produce their inputs, where a graph break at each
linear would compile a layer as pieces and write every input before casting it. The packed
attention's BlockMask of each mask is built once per forward, outside the compiled layers, and
passed to them (target_attention.BlockMasks).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from .target_attention import BLOCK_MASK, BlockMasks
from .thread_switch import ThreadSwitch

# relative L2 error of a fused layer's output against its eager output on the same input above
# which the fused layers are not kept: fused reductions round differently, a wrong compile is off
# by the size of the output. One layer, not the stack: a deep random-weight target (benchmarks)
# amplifies any rounding difference layer after layer, as it amplifies FP8's.
FUSED_TOLERANCE = 0.05
# the same with FP8 linears: each rounds its input to e4m3's three mantissa bits, so two inputs a
# bf16 rounding apart (the fused attention's and the eager one's) come out of a layer's four cast
# GEMMs several percent apart, about FP8's own error; a wrong compile is still off by far more
FUSED_TOLERANCE_FP8 = 0.15


def fused_tolerance(fp8: bool) -> float:
    """How far a fused layer may be off the eager one: FUSED_TOLERANCE, FUSED_TOLERANCE_FP8 with
    FP8 linears."""
    return FUSED_TOLERANCE_FP8 if fp8 else FUSED_TOLERANCE


def run_target_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """One decoder layer's own forward, called as a free function (the layer's `forward`
    attribute is the dispatcher below)."""
    return type(layer).forward(layer, *args, **kwargs)


@functools.cache
def compiled_target_layer():
    # emulate_precision_casts: the fused kernels round where the eager ops round (to bf16 between
    # ops), so the fused layer differs from the eager one by reduction order only
    return torch.compile(run_target_layer, dynamic=False, options={"emulate_precision_casts": True})


class _LayerForward:
    """A layer's forward: the compiled one while its fusion is active in this thread (with the
    BlockMask of its attention mask, built once for the forward), else the class's eager one."""

    def __init__(self, layer: nn.Module, switch: ThreadSwitch):
        self.layer, self.switch = layer, switch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.switch.is_on:
            return type(self.layer).forward(self.layer, *args, **kwargs)
        masks = self.switch.value
        block_mask = masks.of(kwargs.get("attention_mask")) if masks is not None else None
        if block_mask is not None:
            kwargs = {**kwargs, BLOCK_MASK: block_mask}
        return compiled_target_layer()(self.layer, *args, **kwargs)


class LayerFusion:
    """The decoder layers of one target, each answering through a `_LayerForward`. packed: their
    attention is the packed flex path (target_attention.use_packed_attention), which takes the
    BlockMasks; without it none are built."""

    def __init__(self, layers: nn.ModuleList, packed: bool = True):
        self._switch = ThreadSwitch()
        self._packed = packed
        self._layers = list(layers)
        for layer in self._layers:
            layer.forward = _LayerForward(layer, self._switch)

    def active(self) -> contextlib.AbstractContextManager[BlockMasks | None]:
        """The compiled layers in the calling thread for the block, one forward: the BlockMasks
        its layers' masks get are built once for it (yielded; None where not packed)."""
        return self._switch.on(BlockMasks() if self._packed else None)

    @torch.no_grad()
    def layer_error(self, run: Any) -> float:
        """The largest relative error of the first and last layer's compiled output against their
        eager output, on the inputs they get in `run()` (a capture with the fusion active)."""
        checked = dict.fromkeys([self._layers[0], self._layers[-1]])
        seen: dict[nn.Module, tuple[tuple, dict]] = {}
        hooks = [
            layer.register_forward_pre_hook(
                lambda module, args, kwargs: seen.setdefault(module, (args, kwargs)), with_kwargs=True
            )
            for layer in checked
        ]
        try:
            with self.active():
                run()
        finally:
            for hook in hooks:
                hook.remove()
        errors = []
        for layer, (args, kwargs) in seen.items():
            eager = _first(type(layer).forward(layer, *args, **kwargs))
            with self.active():
                fused = _first(layer.forward(*args, **kwargs))
            errors.append(relative_error(fused, eager))
        return max(errors, default=0.0)

    def remove(self) -> None:
        """Back to the layers' own forward."""
        for layer in self._layers:
            layer.__dict__.pop("forward", None)


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def relative_error(fused: torch.Tensor, eager: torch.Tensor) -> float:
    """||fused - eager|| / ||eager|| in fp32 (0 where both are zero)."""
    diff = torch.linalg.vector_norm((fused.float() - eager.float()).flatten())
    norm = torch.linalg.vector_norm(eager.float().flatten())
    return float(diff / norm) if float(norm) > 0 else float(diff)
