"""The target's RMSNorms through one Triton kernel (kernels/rms_norm.py) in its eager forwards.

The regeneration decoder runs the target's own decoder eagerly (its decode step recorded as a
CUDA graph, its prefill as it comes), where every RMSNorm is a chain of small kernels: four norms
a layer (input, post-attention, the per-head query and key norms of Qwen3 and Gemma), each some
seven launches over the whole activation. `NormKernels` puts a dispatcher in place of each norm's
`forward` (by giving the module a subclass of its class, module_dispatch.py): while it is active in the calling
thread it runs the kernel, else the norm's own forward, so the engine's other users of the target
(its recorded capture, compiled at warm-up, whose trace takes the module's own forward) see the
module as it was.

Which modules are norms, and which weighting each class uses, is derived, not named: a module
with one 1-D weight, no other parameters, no children and an epsilon is a candidate, and its
class is taken with the weighting whose output equals the class's own forward on a probe (within
rounding); a class that matches neither stays eager.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .module_dispatch import Dispatching, ModuleKernels, base_class

__all__ = ["NormKernels", "base_class", "norm_epsilon"]

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


class _NormDispatching(Dispatching):
    """The kernel while the module's NormKernels are active in this thread and its class was
    matched, else the class's own forward (always so under a compiler's trace)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = self._dflash_base
        if not torch.compiler.is_compiling() and not args and not kwargs:
            owner: NormKernels | None = self.__dict__.get("_dflash_norms")
            weighting = owner.matched_now(base) if owner is not None else None
            if weighting is not None:
                from .kernels.rms_norm import rms_norm, supports

                weight: torch.Tensor = self.weight  # type: ignore[attr-defined]
                if supports(hidden_states, weight):
                    return rms_norm(hidden_states, weight, self.__dict__["_dflash_eps"], weighting)
        return base.forward(self, hidden_states, *args, **kwargs)


class NormKernels(ModuleKernels):
    """The dispatchers of one model's norms, and the weighting matched per norm class."""

    mixin = _NormDispatching
    owner_field = "_dflash_norms"
    kind = "norm"

    def fields(self, module: nn.Module) -> dict[str, Any] | None:
        eps = norm_epsilon(module)
        return None if eps is None else {"_dflash_eps": eps}

    def probe(self, module: nn.Module) -> str | None:
        return _match(module)


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
