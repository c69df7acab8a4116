"""The checkpoint writer: one write in flight, finished writes reported in order, a failed write
surfaces as an error."""
import threading

import pytest

from dflash_core.engine.checkpoint_writer import CheckpointWriter


def test_one_write_in_flight_and_results_in_order():
    writer = CheckpointWriter()
    release = threading.Event()
    started = threading.Event()

    def slow():
        started.set()
        assert release.wait(10)
        return "ckpt-1"

    writer.submit(slow, 1)
    assert started.wait(10)
    assert writer.poll() == []  # still writing: polling does not wait
    with pytest.raises(RuntimeError, match="in flight"):
        writer.submit(lambda: "ckpt-2", 2)  # never two snapshots at once
    release.set()
    assert writer.wait() == [("ckpt-1", 1)]
    writer.submit(lambda: "ckpt-2", 2)
    assert writer.wait() == [("ckpt-2", 2)]
    assert writer.wait() == [] and writer.poll() == []
    writer.close()


def test_failed_write_is_raised():
    writer = CheckpointWriter()

    def broken():
        raise OSError("disk full")

    writer.submit(broken, 3)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert writer.wait() == []  # reported once
    writer.close()
