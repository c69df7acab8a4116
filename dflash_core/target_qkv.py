"""The target's query, key and value projections as one GEMM in the regeneration decoder.

An attention layer projects its input three times (`q_proj`, `k_proj`, `v_proj`: three GEMMs over
the same rows). In a decode step of a few hundred rows the key and value GEMMs are narrow (a
grouped-query model's are a quarter or an eighth of the query's width), and each of the three
pays its own launch and its own pass over the input: one GEMM against the three weights
stacked is shorter than the three apart. The layer itself is transformers' code and stays so:
`QkvDispatch` gives each of the three modules a dispatching class (module_dispatch.py) when the
target loads, and a `FusedQkv` (the stacked weights, made by a decoder for its lifetime) turns
them on in the decoder's thread. There the query projection runs the stacked GEMM and hands back
its columns; the key and value projections, called next on the same input tensor, hand back
theirs without a GEMM of their own. Any other call (another input, another order, another
thread, a compiler's trace) runs the module's own forward, so the engine's compiled capture sees
the modules as they were, and what a projection returns is always its own product.

The stacked weights are a copy (the modules keep their parameters, which a continual job's
target swap writes in place): `FusedQkv.refresh()` copies them in again, and the decoder calls it
at the start of every `generate`, so a swapped target is never decoded with stale weights. Taken
where the three are plain `nn.Linear` of one input width, dtype and device, with biases on all
three or none (an FP8 target's linears are its own class and keep their GEMMs).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .module_dispatch import Dispatching, dispatching_class
from .thread_switch import ThreadSwitch

ROLES = ("q_proj", "k_proj", "v_proj")
_INSTALL_LOCK = threading.Lock()


class _Projecting(Dispatching):
    """Mixed into a projection's class: its columns of the stacked GEMM while a FusedQkv of its
    model is on in this thread, else the class's own forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and not torch.compiler.is_compiling():
            place: tuple[QkvDispatch, int, int] | None = self.__dict__.get("_dflash_qkv")
            if place is not None:
                fused: FusedQkv | None = place[0].switch.value
                if fused is not None:
                    out = fused.project(place[1], place[2], x)
                    if out is not None:
                        return out
        return self._dflash_base.forward(self, x, *args, **kwargs)


def _trio(module: nn.Module) -> list[nn.Linear] | None:
    """The module's q, k and v projections where one GEMM can stand for them, else None."""
    found = [getattr(module, name, None) for name in ROLES]
    if not all(type(m) is nn.Linear for m in found):  # an FP8 linear, a LoRA wrapper: their own GEMMs
        return None
    trio: list[nn.Linear] = found  # type: ignore[assignment]
    w = trio[0].weight
    same = all(m.in_features == trio[0].in_features and m.weight.dtype == w.dtype for m in trio)
    same = same and all(m.weight.device == w.device and "forward" not in m.__dict__ for m in trio)
    biases = {m.bias is None for m in trio}
    return trio if same and len(biases) == 1 else None


class QkvDispatch:
    """The dispatching classes on one model's q/k/v projections, and the switch a FusedQkv turns
    on; installed once per model (`of`), before anything compiles its layers."""

    def __init__(self, model: nn.Module):
        self.switch = ThreadSwitch()
        self.groups: list[list[nn.Linear]] = []
        # the language model's layers only: a multimodal target's vision tower never decodes
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else model
        for module in decoder.modules():
            trio = _trio(module)
            if trio is None:
                continue
            for role, linear in enumerate(trio):
                linear.__class__ = dispatching_class(nn.Linear, _Projecting)  # type: ignore[assignment]
                linear.__dict__["_dflash_qkv"] = (self, len(self.groups), role)
            self.groups.append(trio)

    @classmethod
    def of(cls, model: nn.Module) -> QkvDispatch:
        """The model's dispatch, installed on the first call."""
        with _INSTALL_LOCK:
            found = model.__dict__.get("_dflash_qkv_dispatch")
            # an unpickled model brings no dispatching classes: install anew
            if found is None or not all(isinstance(m, _Projecting) for g in found.groups for m in g):
                found = cls(model)
                model.__dict__["_dflash_qkv_dispatch"] = found
            return found

    def stacked_bytes(self) -> int:
        """Device bytes a FusedQkv of this model holds."""
        return sum(m.weight.numel() * m.weight.element_size() for g in self.groups for m in g) + sum(
            m.bias.numel() * m.bias.element_size() for g in self.groups for m in g if m.bias is not None
        )


class FusedQkv:
    """The stacked weights of a model's q/k/v projections (a copy), and the one GEMM per layer
    that stands for the three while `active()` in the calling thread."""

    def __init__(self, dispatch: QkvDispatch):
        self.dispatch = dispatch
        self.weights = [torch.cat([m.weight.detach() for m in g]) for g in dispatch.groups]
        self.biases = [
            torch.cat([m.bias.detach() for m in g]) if g[0].bias is not None else None for g in dispatch.groups
        ]
        self.bounds = [self._bounds(g) for g in dispatch.groups]
        # (group, input, its version then, stacked output) of the last query call
        self._pending: tuple[int, torch.Tensor, int, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + sum(b.nbytes for b in self.biases if b is not None)

    @staticmethod
    def _bounds(group: list[nn.Linear]) -> list[tuple[int, int]]:
        """Each projection's columns of the stacked output, (first, past the last)."""
        ends = list(itertools.accumulate(m.out_features for m in group))
        return [(end - m.out_features, end) for m, end in zip(group, ends)]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the projections' current weights in (after a target swap wrote them in place)."""
        for g, weight, bias, bounds in zip(self.dispatch.groups, self.weights, self.biases, self.bounds):
            for m, (lo, hi) in zip(g, bounds):
                weight[lo:hi].copy_(m.weight)
                if bias is not None:
                    bias[lo:hi].copy_(m.bias)

    def active(self) -> contextlib.AbstractContextManager[Any]:
        self._pending = None
        return self.dispatch.switch.on(self)

    def project(self, group: int, role: int, x: torch.Tensor) -> torch.Tensor | None:
        """The role's columns of the group's stacked GEMM over x: computed at the query's call,
        kept for the key's and the value's calls on the same tensor; None where the module must
        run its own GEMM (a key or value call that no query call on x came before)."""
        lo, hi = self.bounds[group][role]
        if role == 0:
            out = F.linear(x, self.weights[group], self.biases[group])
            self._pending = (group, x, x._version, out)
            return out[..., lo:hi]
        pending = self._pending
        # the same tensor, unchanged since (an in-place write between the calls bumps its version)
        if pending is None or pending[0] != group or pending[1] is not x or pending[2] != x._version:
            return None
        if role == len(ROLES) - 1:
            self._pending = None  # the last of the three: the input and output go
        return pending[3][..., lo:hi]


def fused_qkv(model: nn.Module) -> FusedQkv | None:
    """The stacked q/k/v weights of the model's attention layers, where any layer has them."""
    dispatch = QkvDispatch.of(model)
    return FusedQkv(dispatch) if dispatch.groups else None
