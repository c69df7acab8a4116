"""The target's gated MLPs with their activation as one Triton kernel (kernels/swiglu.py) in their
eager forwards.

The regeneration decoder runs the target's own decoder eagerly, where a gated MLP's
`act_fn(gate_proj(x)) * up_proj(x)` is two kernels over the layer's widest activation between its
GEMMs. `MlpKernels` gives each gated MLP a dispatching subclass of its class (module_dispatch.py):
while active in the calling thread, a matched class runs `down_proj(silu_mul(gate_proj(x),
up_proj(x)))`, else (and always under a compiler's trace) its own forward, so the engine's
compiled capture sees the module as it was. Install before anything compiles the layers: a
compiled layer guards on its modules' types (the engine's TargetModel installs when it loads).

Which modules are gated MLPs is derived, not named: a module with `gate_proj`, `up_proj` and
`down_proj` submodules and an `act_fn`, whose class's forward uses all four. A class is taken
only where the dispatch's output equals the class's own forward on a probe, bit for bit, so a
family whose activation is not SiLU (Gemma's tanh GELU), or whose MLP computes otherwise, stays
eager and the kernel never changes what a decoder computes.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from .module_dispatch import Dispatching, ModuleKernels, base_class

log = logging.getLogger("dflash.target")

_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class _MlpDispatching(Dispatching):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = self._dflash_base
        if not torch.compiler.is_compiling() and not args and not kwargs:
            owner: MlpKernels | None = self.__dict__.get("_dflash_mlp")
            if owner is not None and owner.matched_now(base):
                return _dispatched(self, x)
        return base.forward(self, x, *args, **kwargs)


def _dispatched(module: Any, x: torch.Tensor) -> torch.Tensor:
    from .kernels.swiglu import silu_mul, supports

    gate, up = module.gate_proj(x), module.up_proj(x)
    if supports(gate, up):
        return module.down_proj(silu_mul(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether `module` has the gated MLP's parts and its class's forward uses them."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in _PARTS[:3]):
        return False
    if not callable(getattr(module, "act_fn", None)):
        return False
    forward = inspect.unwrap(base_class(module).forward)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    return all(name in names for name in _PARTS)


class MlpKernels(ModuleKernels):
    """The dispatchers of one model's gated MLPs; a class's verdict is True where it matched."""

    mixin = _MlpDispatching
    owner_field = "_dflash_mlp"
    kind = "gated MLP"

    def fields(self, module: nn.Module) -> dict[str, Any] | None:
        return {} if is_gated_mlp(module) else None

    def probe(self, module: nn.Module) -> bool | None:
        return _match(module)


def _width(module: nn.Module) -> int | None:
    gate = module.gate_proj
    width = getattr(gate, "in_features", None)
    if isinstance(width, int):
        return width
    weight = getattr(gate, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


@torch.no_grad()
def _match(module: nn.Module) -> bool | None:
    from .kernels.swiglu import DTYPES, runs_on

    param = next(module.parameters(), None)
    width = _width(module)
    if param is None or width is None or not runs_on(param.device):
        return None
    # the activations' dtype: the parameters', bf16 where they are stored in one byte (FP8); a
    # dtype the kernel does not take gives an output the check below refuses
    dtype = torch.bfloat16 if param.dtype.itemsize == 1 else param.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = (torch.randn(8, width, generator=gen) * 2).to(device=param.device, dtype=dtype)
    try:
        expected = base_class(module).forward(module, probe)
        got = _dispatched(module, probe)
    except Exception as e:  # noqa: BLE001 - a module this probe cannot run keeps its own forward
        log.warning("gated MLP class %s: the probe failed (%s); it runs eagerly", type(module).__name__, e)
        return None
    if not isinstance(expected, torch.Tensor) or expected.dtype not in DTYPES:
        return None
    return True if expected.dtype == got.dtype and torch.equal(expected, got) else None
