"""The build's library imports (dflash_core/libraries.py) leave the garbage collector as they
found it: on, off where the caller turned it off, and nothing frozen, so that what a process held
in reference cycles before a build is still collected after it."""

import gc
import weakref

from dflash_core.libraries import collector_paused, import_engine_libraries, import_target_libraries


class _Node:
    pass


def test_the_imports_leave_the_collector_on_and_nothing_frozen():
    node = _Node()
    node.me = node  # a cycle: only the collector frees it
    alive = weakref.ref(node)
    frozen = gc.get_freeze_count()
    import_engine_libraries()
    import_target_libraries()
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    del node
    gc.collect()
    assert alive() is None, "a cycle made before the imports outlived them"


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
