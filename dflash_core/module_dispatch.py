"""A target module's class with a dispatching forward: the decoder's path in one thread, the
class's own forward everywhere else.

The regeneration decoder runs some of the target's modules otherwise than their own forward (the
RMSNorms through a kernel, target_norms.py; the query, key and value projections as one GEMM,
target_qkv.py), while the engine's other users of the same modules (its capture, compiled at
warm-up) must see them as they were. Each such module gets a subclass of its class whose
`forward` dispatches (a mixin's); one subclass per (mixin, class) rather than a forward per
module, since a compiled layer guards on its modules' types and every layer must still share one
graph. The subclass keeps the class's name (a printed model reads as before) and is an instance
of it (isinstance checks hold); a deep copy keeps it, a pickle or a shallow copy drops it.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from torch import nn


class Dispatching:
    """Mixed in before a module's class by `dispatching_class`; a mixin writes `forward`, which
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
