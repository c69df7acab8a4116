"""The target's RMSNorms through one Triton kernel (kernels/rms_norm.py) in its eager forwards.

The regeneration decoder runs the target's own decoder eagerly (its decode step recorded as a
CUDA graph, its prefill as it comes), where every RMSNorm is a chain of small kernels: four norms
a layer (input, post-attention, the per-head query and key norms of Qwen3 and Gemma), each some
seven launches over the whole activation. `NormKernels` puts a dispatcher in place of each norm's
`forward` (by giving the module a subclass of its class): while it is active in the calling
thread it runs the kernel, else the norm's own forward, so the engine's other users of the target
(its recorded capture, compiled at warm-up, whose trace takes the module's own forward) see the
module as it was.

Which modules are norms, and which weighting each class uses, is derived, not named: a module
with one 1-D weight, no other parameters, no children and an epsilon is a candidate, and its
class is taken with the weighting whose output equals the class's own forward on a probe (within
rounding); a class that matches neither stays eager.
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

# relative L2 distance of the kernel's output from the class's own forward on the probe, above
# which a weighting is not taken: the two differ by the order of a row's sum (a rounding step of
# the output dtype on a few elements), a wrong weighting by the size of the output
MATCH_TOLERANCE = 1e-2
_EPS_NAMES = ("variance_epsilon", "eps")


def norm_epsilon(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm-like module (one 1-D weight, nothing else), else None."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1:
        return None
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


class _Dispatching(Dispatching):
    """Mixed into a norm class: the kernel while the module's NormKernels are active in this
    thread and its class was matched, else the class's own forward (always so under a compiler's
    trace)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = self._dflash_base
        if not torch.compiler.is_compiling() and not args and not kwargs:
            owner: NormKernels | None = self.__dict__.get("_dflash_norms")
            weighting = owner.weighting_now(base) if owner is not None else None
            if weighting is not None:
                from .kernels.rms_norm import rms_norm, supports

                weight: torch.Tensor = self.weight  # type: ignore[attr-defined]
                if supports(hidden_states, weight):
                    return rms_norm(hidden_states, weight, self.__dict__["_dflash_eps"], weighting)
        return base.forward(self, hidden_states, *args, **kwargs)


class NormKernels:
    """The dispatchers of one model's norms, and the weighting matched per norm class."""

    def __init__(self, model: nn.Module):
        self._switch = ThreadSwitch()
        self._lock = threading.Lock()
        self._modules: list[nn.Module] = []
        self._weighting: dict[type, str | None] = {}  # per class: matched (None: stays eager)
        for module in model.modules():
            eps = norm_epsilon(module)
            # a module whose forward someone else replaced, or already dispatching, is left as it is
            if eps is None or "forward" in module.__dict__ or isinstance(module, Dispatching):
                continue
            module.__class__ = dispatching_class(type(module), _Dispatching)
            module.__dict__["_dflash_norms"] = self
            module.__dict__["_dflash_eps"] = eps
            self._modules.append(module)

    def __getstate__(self) -> dict[str, Any]:
        # a copied model (copy.deepcopy) carries its registry along, an unpickled one too (`of`
        # then installs anew); the lock is per object, not copied
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: nn.Module) -> NormKernels:
        """The model's dispatchers, installed on the first call."""
        found = model.__dict__.get("_dflash_norm_kernels")
        # an unpickled model brings its registry but not the dispatching classes: install anew
        if found is None or not all(isinstance(m, _Dispatching) for m in found._modules):
            found = cls(model)
            model.__dict__["_dflash_norm_kernels"] = found
        return found

    @property
    def count(self) -> int:
        return len(self._modules)

    def weighting_now(self, cls: type) -> str | None:
        return self._weighting.get(cls) if self._switch.is_on else None

    def match(self) -> dict[str, str | None]:
        """The weighting of each norm class (probed once per class on its first module's device
        and dtype): class name -> weighting, or None where the class stays eager."""
        with self._lock:
            first: dict[type, nn.Module] = {}  # the first module of each class is the probe's
            for module in self._modules:
                first.setdefault(base_class(module), module)
            for cls, module in first.items():
                if cls not in self._weighting:
                    self._weighting[cls] = _match(module)
                    log.info("norm class %s runs as %s", cls.__name__, self._weighting[cls] or "its own forward")
        return {cls.__name__: w for cls, w in self._weighting.items()}

    def usable(self) -> bool:
        """Whether any norm runs through the kernel when active."""
        return any(w is not None for w in self.match().values())

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The kernel for the matched norms in the calling thread for the block."""
        self.match()
        return self._switch.on()


@torch.no_grad()
def _match(module: nn.Module) -> str | None:
    from .kernels.rms_norm import WEIGHTINGS, rms_norm, runs_on

    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    if not runs_on(weight.device):
        return None
    eps = norm_epsilon(module)
    assert eps is not None
    own = base_class(module).forward
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = (torch.randn(8, weight.shape[0], generator=gen) * 3).to(device=weight.device, dtype=weight.dtype)
    try:
        expected = own(module, probe)
    except Exception:  # noqa: BLE001 - a forward that takes more than one tensor is not a norm this kernel replaces
        return None
    if not isinstance(expected, torch.Tensor) or expected.shape != probe.shape:
        return None
    for weighting in WEIGHTINGS:
        try:
            got = rms_norm(probe, weight, eps, weighting)
        except Exception as e:  # noqa: BLE001 - the kernel does not build here: the norm keeps its own forward
            log.warning("norm class %s: the RMSNorm kernel failed (%s); it runs eagerly", type(module).__name__, e)
            return None
        if got.dtype != expected.dtype:
            continue
        diff = torch.linalg.vector_norm((got.float() - expected.float()).flatten())
        if float(diff) <= MATCH_TOLERANCE * float(torch.linalg.vector_norm(expected.float().flatten())):
            return weighting
    return None
