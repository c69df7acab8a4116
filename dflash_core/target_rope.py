"""The target's rotary embedding through one Triton kernel (kernels/rope.py) in its eager forwards.

A transformers attention layer applies RoPE by calling its modeling module's own
`apply_rotary_pos_emb(q, k, cos, sin)`, a function of the module, not a submodule a model could
swap. `RopeKernels` puts a dispatcher in that function's place, once per modeling module, before
anything compiles the layers: while a RopeKernels is active in the calling thread and the
function was matched, the dispatcher runs the kernel, else the function itself (always so under a
compiler's trace, so the engine's compiled capture traces the eager code, and every other thread
runs it too).

Which function is taken is derived, not named: the dispatcher goes where an attention class's
forward calls `apply_rotary_pos_emb`, and the kernel is used only where its output equals the
function's own on a probe, bit for bit; a family whose function rotates otherwise (interleaved
pairs, a partial rotary width) or rounds otherwise (in fp32, once) stays eager, so the kernel
never changes what a decoder computes.

Install before anything compiles the model's layers: a compiled frame guards on the function it
traced, so a later install makes it compile again (the engine's TargetModel installs when it
loads; a regeneration decoder installs on models that did not come through it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .thread_switch import ThreadSwitch

log = logging.getLogger("dflash.target")

NAME = "apply_rotary_pos_emb"
_ACTIVE = ThreadSwitch()  # the function is process-wide: which thread runs the kernel is too
_LOCK = threading.Lock()
_MATCHED: dict[tuple[Callable, str, torch.dtype], bool] = {}


def dispatcher(original: Callable) -> Callable:
    """`original` behind the dispatch (see the module's docstring)."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, **kwargs: Any):
        if not args and not kwargs and not torch.compiler.is_compiling() and _ACTIVE.is_on:
            from .kernels.rope import apply_rope, supports

            if supports(q, k, cos, sin) and _matched(original, q.device, q.dtype):
                return apply_rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._dflash_rope_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def original_of(fn: Callable) -> Callable:
    """The modeling module's own function under a dispatcher (fn itself where there is none)."""
    return getattr(fn, "_dflash_rope_original", fn)


def install(model: nn.Module) -> list[str]:
    """Put the dispatcher in place of `apply_rotary_pos_emb` in the modeling module of every
    attention class of `model` whose forward calls it (the module the forward was written in, an
    inherited forward's too; once per module); the modules' names."""
    names = set()
    seen: set[type] = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        forward = getattr(cls, "forward", None)
        if callable(forward):  # a decorated forward: the function written in the modeling module
            forward = inspect.unwrap(forward)
        code = getattr(forward, "__code__", None)
        home = getattr(forward, "__globals__", None)
        if code is None or home is None or NAME not in code.co_names or not callable(home.get(NAME)):
            continue
        with _LOCK:
            fn = home[NAME]
            if original_of(fn) is fn:
                home[NAME] = dispatcher(fn)
        names.add(str(home.get("__name__", forward.__module__)))
    return sorted(names)


class RopeKernels:
    """The rotary kernel for one model's attention layers, on in the calling thread while active."""

    def __init__(self, model: nn.Module):
        self.modules = install(model)
        self._functions = [getattr(sys.modules[name], NAME) for name in self.modules if name in sys.modules]
        params = next(model.parameters(), None)
        self._device = params.device if params is not None else torch.device("cpu")
        self._dtype = params.dtype if params is not None else torch.float32

    def usable(self, dtype: torch.dtype | None = None) -> bool:
        """Whether a matched function runs through the kernel here (probed on the model's device,
        in `dtype`: the activations' dtype, the parameters' by default)."""
        dtype = dtype or self._dtype
        return any(_matched(original_of(fn), self._device, dtype) for fn in self._functions)

    def active(self) -> contextlib.AbstractContextManager[None]:
        return _ACTIVE.on()


def _matched(original: Callable, device: torch.device, dtype: torch.dtype) -> bool:
    key = (original, str(device), dtype)
    with _LOCK:
        found = _MATCHED.get(key)
    if found is None:
        found = _probe(original, device, dtype)
        with _LOCK:
            _MATCHED[key] = found
        log.info(
            "rotary embedding %s.%s runs as %s",
            getattr(original, "__module__", "?"),
            NAME,
            "the kernel" if found else "its own function",
            extra={"fields": {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}},
        )
    return found


@torch.no_grad()
def _probe(original: Callable, device: torch.device, dtype: torch.dtype) -> bool:
    try:
        from .kernels.rope import apply_rope, runs_on, supports
    except ImportError:  # no Triton: the function itself
        return False
    if not runs_on(device):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, h, hk, s, d = 3, 4, 2, 5, 64

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(device=device, dtype=dtype)

    q, k = draw(b, s, h, d).transpose(1, 2), draw(b, s, hk, d).transpose(1, 2)
    angle = torch.rand(b, s, d // 2, generator=gen) * 6.3
    angle = torch.cat([angle, angle], dim=-1)  # the rotary embeddings' layout: the frequencies twice
    cos, sin = angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)
    if not supports(q, k, cos, sin):
        return False
    try:
        expected = original(q, k, cos, sin)
        got = apply_rope(q, k, cos, sin)
    except Exception as e:  # noqa: BLE001 - a function or kernel that fails here keeps the eager path
        log.warning("rotary embedding %s: the probe failed (%s); it runs eagerly", NAME, e)
        return False
    if not isinstance(expected, tuple) or len(expected) != 2:
        return False
    return all(
        isinstance(want, torch.Tensor)
        and want.dtype == have.dtype
        and want.shape == have.shape
        and torch.equal(want, have)
        for want, have in zip(expected, got, strict=True)
    )
