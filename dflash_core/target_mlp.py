"""The target's gated MLPs with their activation and product as one kernel (kernels/swiglu.py) in
the regeneration decoder.

A gated MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) runs its SiLU and its product
eagerly as two kernels over the intermediate width, the layer's widest activation. `MlpKernels`
gives each such module a dispatching class (module_dispatch.py) when the target loads: while it
is active in the calling thread, the module runs its own three projections (whatever they are: an
FP8 target's linears keep their GEMMs) with the kernel between them; anywhere else (another
thread, a compiler's trace: the engine's compiled capture) it runs its own forward.

Which modules are gated MLPs is derived, not named: a module with `gate_proj`, `up_proj` and
`down_proj` children, an `act_fn` and no parameters of its own is a candidate, and its class is
taken where the kernel's path equals the class's own forward on a probe (within rounding; a class
whose activation is not SiLU, Gemma's GELU, stays eager).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch import nn

from .module_dispatch import Dispatching, base_class, dispatching_class
from .thread_switch import ThreadSwitch

log = logging.getLogger("dflash.target")

# relative L2 distance of the kernel's path from the class's own forward on the probe above which
# the class is not taken: the two round alike (the same projections, the product rounded where
# the eager ops round it), another activation is off by a large share of the output
MATCH_TOLERANCE = 1e-2
_ROLES = ("gate_proj", "up_proj", "down_proj")


def gated_mlp(module: nn.Module) -> bool:
    """Whether the module has a gated MLP's parts: the three projections, an activation, no
    parameters of its own."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in _ROLES):
        return False
    return callable(getattr(module, "act_fn", None)) and not any(True for _ in module.parameters(recurse=False))


def _kernel_path(module: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The MLP with its activation and product through the kernel; None where it takes neither
    projection's output."""
    from .kernels.swiglu import silu_mul, supports

    gate = module.gate_proj(x)
    up = module.up_proj(x)
    if not supports(gate, up):
        return None
    return module.down_proj(silu_mul(gate, up))


class _Gated(Dispatching):
    """Mixed into a gated MLP's class: the kernel's path while the module's MlpKernels are active
    in this thread and its class was matched, else the class's own forward (always so under a
    compiler's trace)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = self._dflash_base
        if not torch.compiler.is_compiling() and not args and not kwargs:
            owner: MlpKernels | None = self.__dict__.get("_dflash_mlp")
            if owner is not None and owner.taken_now(base):
                out = _kernel_path(self, x)
                if out is not None:
                    return out
        return base.forward(self, x, *args, **kwargs)


class MlpKernels:
    """The dispatchers of one model's gated MLPs, and which of their classes the kernel serves."""

    def __init__(self, model: nn.Module):
        self._switch = ThreadSwitch()
        self._lock = threading.Lock()
        self._modules: list[nn.Module] = []
        self._taken: dict[type, bool] = {}  # per class: whether the probe matched
        for module in model.modules():
            # a module whose forward someone else replaced, or already dispatching, is left as it is
            if not gated_mlp(module) or "forward" in module.__dict__ or isinstance(module, Dispatching):
                continue
            module.__class__ = dispatching_class(type(module), _Gated)
            module.__dict__["_dflash_mlp"] = self
            self._modules.append(module)

    def __getstate__(self) -> dict[str, Any]:
        # a copied model carries its registry along; the lock is per object, not copied
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: nn.Module) -> MlpKernels:
        """The model's dispatchers, installed on the first call."""
        found = model.__dict__.get("_dflash_mlp_kernels")
        # an unpickled model brings its registry but not the dispatching classes: install anew
        if found is None or not all(isinstance(m, _Gated) for m in found._modules):
            found = cls(model)
            model.__dict__["_dflash_mlp_kernels"] = found
        return found

    @property
    def count(self) -> int:
        return len(self._modules)

    def taken_now(self, cls: type) -> bool:
        return self._switch.is_on and self._taken.get(cls, False)

    def match(self) -> dict[str, bool]:
        """Whether the kernel serves each MLP class (probed once per class on its first module's
        device and dtype): class name -> taken."""
        with self._lock:
            first: dict[type, nn.Module] = {}
            for module in self._modules:
                first.setdefault(base_class(module), module)
            for cls, module in first.items():
                if cls not in self._taken:
                    self._taken[cls] = _match(module)
                    log.info(
                        "MLP class %s runs %s",
                        cls.__name__,
                        "through the SwiGLU kernel" if self._taken[cls] else "as its own forward",
                    )
        return {cls.__name__: taken for cls, taken in self._taken.items()}

    def usable(self) -> bool:
        """Whether any MLP runs through the kernel when active."""
        return any(self.match().values())

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The kernel for the matched MLPs in the calling thread for the block."""
        self.match()
        return self._switch.on()


@torch.no_grad()
def _match(module: nn.Module) -> bool:
    from .kernels.swiglu import runs_on

    param = next(module.parameters(), None)
    buffer = next(module.buffers(), None)
    like = param if param is not None else buffer
    if like is None or not runs_on(like.device):
        return False
    width = getattr(module.gate_proj, "in_features", None)
    if not isinstance(width, int):
        return False
    dtype = like.dtype if like.is_floating_point() and like.element_size() > 1 else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(8, width, generator=gen).to(device=like.device, dtype=dtype)
    try:
        expected = base_class(module).forward(module, probe)
        got = _kernel_path(module, probe)
    except Exception as e:  # noqa: BLE001 - a module or kernel that does not run here stays eager
        log.warning("MLP class %s: the SwiGLU kernel's path failed (%s); it runs eagerly", type(module).__name__, e)
        return False
    if got is None or not isinstance(expected, torch.Tensor) or got.shape != expected.shape:
        return False
    diff = torch.linalg.vector_norm((got.float() - expected.float()).flatten())
    return float(diff) <= MATCH_TOLERANCE * float(torch.linalg.vector_norm(expected.float().flatten()))
