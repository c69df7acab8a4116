"""A target module's class with a dispatching forward: the kernel path for one thread, the class's
own forward everywhere else.

The regeneration decoder runs some of the target's modules (its RMSNorms, target_norms.py)
through Triton kernels, while the engine's other users of the same modules (its capture, compiled
at warm-up) must see them as they were. Each such module gets a subclass of its class whose
`forward` dispatches (the mixin's); one subclass per (mixin, class) rather than a forward per
module, since a compiled layer guards on its modules' types and every layer must still share one
graph. The subclass keeps the class's name (a printed model reads as before) and is an instance
of it (isinstance checks hold); a copy keeps it, a pickle drops it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any

from torch import nn

from .thread_switch import ThreadSwitch

log = logging.getLogger("dflash.target")


class Dispatching:
    """Mixed in before a module's class by `dispatching_class`; subclasses write `forward`, which
    falls back to `self._dflash_base.forward`. Fields the dispatch needs go in the module's
    `__dict__` under names starting with `_dflash_`: a pickle leaves them out."""

    _dflash_base: type[nn.Module]

    def __deepcopy__(self, memo: dict[int, Any]) -> Dispatching:
        # a copy in this process keeps the dispatching class, with the copied model's dispatchers
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))  # type: ignore[attr-defined]
        return twin

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # pickled as the module's own class, without the dispatcher's fields: the dispatching
        # class exists only in the process that made it
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_dflash_")}
        return (_rebuilt, (self._dflash_base, state))


def _rebuilt(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module


_CLASSES: dict[tuple[type, type], type] = {}
_LOCK = threading.Lock()


def dispatching_class(cls: type[nn.Module], mixin: type[Dispatching]) -> type[nn.Module]:
    """`cls` with `mixin`'s dispatching forward, made once per pair."""
    with _LOCK:
        found = _CLASSES.get((mixin, cls))
        if found is None:
            found = type(cls.__name__, (mixin, cls), {"_dflash_base": cls, "__module__": cls.__module__})
            _CLASSES[(mixin, cls)] = found
        return found


def base_class(module: nn.Module) -> type[nn.Module]:
    """The module's own class, under the dispatching one where it was installed."""
    return getattr(type(module), "_dflash_base", type(module))


class ModuleKernels:
    """The dispatchers of one model's modules of one kind, and what each class was matched with.

    A subclass names its mixin, the field of a module that points back at its owner, what a module
    must be (`fields`: the values its dispatch needs, or None where it is not one) and how a class
    is matched (`probe`: on the class's first module, on its device and dtype; None where the
    class stays with its own forward). The dispatch of a matched class runs only in a thread
    inside `active()`."""

    mixin: type[Dispatching]
    owner_field: str
    kind: str  # for the log: "norm"

    def __init__(self, model: nn.Module):
        self._switch = ThreadSwitch()
        self._lock = threading.Lock()
        self._modules: list[nn.Module] = []
        self._matched: dict[type, Any] = {}  # per class: its probe's verdict (None: stays eager)
        for module in model.modules():
            # a module whose forward someone else replaced, or already dispatching, is left as it is
            if "forward" in module.__dict__ or isinstance(module, Dispatching):
                continue
            fields = self.fields(module)
            if fields is None:
                continue
            module.__class__ = dispatching_class(type(module), self.mixin)
            module.__dict__[self.owner_field] = self
            module.__dict__.update(fields)
            self._modules.append(module)

    def fields(self, module: nn.Module) -> dict[str, Any] | None:
        raise NotImplementedError

    def probe(self, module: nn.Module) -> Any:
        raise NotImplementedError

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
    def of(cls, model: nn.Module) -> Any:
        """The model's dispatchers of this kind, installed on the first call."""
        key = f"_dflash_{cls.__name__}"
        found = model.__dict__.get(key)
        # an unpickled model brings its registry but not the dispatching classes: install anew
        if found is None or not all(isinstance(m, cls.mixin) for m in found._modules):
            found = cls(model)
            model.__dict__[key] = found
        return found

    @property
    def count(self) -> int:
        return len(self._modules)

    def matched_now(self, cls: type) -> Any:
        """The class's verdict while active in the calling thread, else None."""
        return self._matched.get(cls) if self._switch.is_on else None

    def match(self) -> dict[str, Any]:
        """Class name -> its verdict (probed once per class), None where it stays eager."""
        with self._lock:
            first: dict[type, nn.Module] = {}  # the first module of each class is the probe's
            for module in self._modules:
                first.setdefault(base_class(module), module)
            for cls, module in first.items():
                if cls not in self._matched:
                    self._matched[cls] = self.probe(module)
                    log.info("%s class %s runs as %s", self.kind, cls.__name__, self._matched[cls] or "its own forward")
        return {cls.__name__: v for cls, v in self._matched.items()}

    def usable(self) -> bool:
        """Whether any module runs through its kernel when active."""
        return any(v is not None for v in self.match().values())

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The kernels of the matched classes in the calling thread for the block."""
        self.match()
        return self._switch.on()
