"""The libraries an engine build imports, imported with the cyclic garbage collector paused.

Importing torch (with sympy and dynamo behind it) and transformers' model classes creates
millions of long-lived objects: functions, classes, their dictionaries. CPython runs a collection
each time allocations outrun deallocations by its threshold, and every so often one over every
object tracked, so an import of that size spends a good part of its time walking objects of which
almost none is garbage, over and over as the heap grows. Paused, those walks are skipped; the
objects the import made are walked once the collector is back on, by whatever allocates next, so
the gain is the repeated walks, not all of them (a daemon's start, timed to ready, is shorter;
the import alone looks shorter than it is). A daemon's start is mostly these imports.

The build imports in two steps, each where it does now: the engine (torch) before the engine
object exists, transformers when the build loads the target, after the engine has pointed the
compile caches at the data directory (dynamo, which transformers imports, fixes inductor's cache
directory when it is imported) and while the devices' CUDA contexts are created beside it.
Nothing is frozen (`gc.freeze()`): a process that builds several engines (a test run, a
benchmark) would keep whatever an earlier build left in reference cycles, device memory included.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator

# transformers' auto classes, which load the target's config, tokenizer and model (the model
# class's own module comes with the target)
TRANSFORMERS_MODULES = (
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was after it: one turned off by the
    caller stays off). Reference counting still frees what the block drops."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def import_engine_libraries() -> None:
    """torch and the engine's modules (what `from dflash_core.engine import Engine` imports;
    nothing that imports dynamo), with the collector paused."""
    with collector_paused():
        importlib.import_module("dflash_core.engine.engine")


def import_target_libraries() -> None:
    """transformers' auto classes, without the optional imports the daemon never uses
    (transformers_imports.py), with the collector paused. Later imports of these modules are
    free."""
    from .transformers_imports import skip_unused_imports

    with collector_paused():
        skip_unused_imports()  # before transformers' generation utilities are first imported
        for name in TRANSFORMERS_MODULES:
            importlib.import_module(name)
