"""The checkpoint writer: one write in flight, finished writes reported in order, a failed write
surfaces as an error."""

import threading

import pytest

from dflash_core.engine.checkpointing import CheckpointWriter


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


def test_failed_write_is_raised():
    writer = CheckpointWriter()

    def broken():
        raise OSError("disk full")

    writer.submit(broken, 3)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    assert writer.wait() == []  # reported once


def test_snapshot_is_not_reached_by_later_training():
    """cpu_copy: in-place updates after the snapshot (weights, AdamW moments and step counters,
    all on the CPU here, where .to("cpu") alone would alias) do not change it."""
    import torch

    from dflash_core.checkpoint import cpu_copy

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    p.grad = torch.ones(4)
    opt.step()
    snap = cpu_copy({"weights": {"p": p}, "optimizer": opt.state_dict()})
    before = {"p": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}}
    opt.step()  # moves the weights, both moments and the step counter in place
    assert torch.equal(snap["weights"]["p"], before["p"]) and not torch.equal(p.detach(), before["p"])
    state = snap["optimizer"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(state[key], before[key]) and not torch.equal(opt.state[p][key], before[key])


def test_rotation_keeps_the_newest_steps_past_10_to_the_8(tmp_path):
    """Rotation orders checkpoints by step number: past step 10^8 the names grow a digit and no
    longer sort by step, and the newest checkpoints must still be the ones kept."""
    from pathlib import Path

    from dflash_core.confine import ConfinedDir
    from dflash_core.engine.checkpointing import rotate_checkpoints, step_dir_name

    for step in (99_999_990, 99_999_999, 100_000_000, 100_000_010):
        (tmp_path / step_dir_name(step)).mkdir()
    partial = tmp_path / ".tmp-step-100000020-abcd1234"  # a write in flight is no checkpoint to rotate
    partial.mkdir()
    with ConfinedDir(tmp_path, [str(tmp_path)]) as directory:
        removed = rotate_checkpoints(directory, keep=2)
    assert sorted(Path(p).name for p in removed) == ["step-99999990", "step-99999999"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [partial.name, "step-100000000", "step-100000010"]


def test_snapshot_preparation_says_when_done_and_stops_on_clear():
    """HostSnapshot.prepare runs in a thread of its own: done() there once every buffer is in
    place, its state pinning then pinned; clear() stops a preparation in flight after the buffer
    it is on, and done() is not called for it."""
    import torch

    from dflash_core.engine.host_snapshot import HostSnapshot

    like = (torch.Size([4, 4]), torch.float32, torch.device("cpu"))  # host tensors need no buffer
    snap, done = HostSnapshot(), []
    assert snap.state == "empty"
    gate = threading.Event()

    def held():  # the first shape once the test has seen the state
        gate.wait(30)
        yield like
        yield like

    snap.prepare(held(), lambda: done.append(threading.current_thread().name))
    assert snap.state == "pinning"
    gate.set()
    snap.wait()
    assert done == ["checkpoint-buffers"] and snap.state == "pinned"

    cancel, first, reached = snap._cancel, threading.Event(), []

    def layout():  # past the first shape only once clear() has asked the preparation to stop
        yield like
        first.set()
        cancel.wait(30)
        reached.append("second")
        yield like
        reached.append("third")
        yield like

    snap.prepare(layout(), lambda: done.append("again"))
    assert first.wait(30)  # the thread is past its first shape, held in the generator
    snap.clear()
    assert reached == ["second"] and done == ["checkpoint-buffers"] and snap._buffers == {}
    assert snap.state == "empty"
    snap.prepare([like], lambda: done.append("after clear"))  # a new preparation is not cancelled
    snap.wait()
    assert done[-1] == "after clear"


def test_snapshot_preparation_that_fails_is_logged_not_raised():
    """A buffer the host cannot allocate: the preparation stops with a warning naming the error,
    done() is not called, and the snapshot stays usable (a checkpoint allocates what is missing)."""
    import logging

    import torch

    from dflash_core.engine.host_snapshot import HostSnapshot

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("dflash.engine")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    snap, done = HostSnapshot(), []
    try:
        # negative: no host allocates it (and on a host without CUDA, nothing pins)
        snap.prepare([(torch.Size([-3]), torch.float32, torch.device("cuda:0"))], lambda: done.append(1))
        snap.wait()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert done == [] and snap.state == "failed"
    warned = [r.getMessage() for r in records if "checkpoint buffers not pinned ahead" in r.getMessage()]
    assert len(warned) == 1, warned
    copy, event = snap.copy({"step": torch.tensor(2.0)})
    assert event is None and copy["step"].item() == 2.0


def test_a_held_preparation_waits_between_buffers_until_released():
    """hold() pauses a preparation before its next buffer (what a job's start and first step do
    while the engine's pinning still runs); release() lets it go on; wait() (a checkpoint's copy
    too) lets a held one go on rather than waiting forever."""
    import time

    import torch

    from dflash_core.engine.host_snapshot import HostSnapshot

    like = (torch.Size([2]), torch.float32, torch.device("cpu"))
    snap, done, fetched = HostSnapshot(), [], []
    first = threading.Event()

    def layout():
        for i in range(3):
            fetched.append(i)
            if i == 0:
                first.set()
            yield like

    snap.hold()
    snap.prepare(layout(), lambda: done.append(1))
    assert first.wait(30)
    time.sleep(0.2)  # held: the thread stays before its first buffer however long this takes
    assert fetched == [0] and done == [] and snap.state == "pinning"
    snap.release()
    snap.wait()
    assert fetched == [0, 1, 2] and done == [1] and snap.state == "pinned"

    snap.hold()  # held again, a later preparation: wait() lets it go on
    snap.prepare([like, like], lambda: done.append(2))
    snap.wait()
    assert done == [1, 2]


def test_a_hold_never_blocks_whoever_waits_for_the_buffers_nor_clear():
    """A wait for the buffers overrides a hold for as long as it waits, even a hold taken while
    it waits (a job starting while the engine closes); clear() stops a held preparation."""
    import torch

    from dflash_core.engine.host_snapshot import HostSnapshot

    like = (torch.Size([2]), torch.float32, torch.device("cpu"))
    snap, done = HostSnapshot(), []
    first, proceed = threading.Event(), threading.Event()

    def layout():
        first.set()
        yield like
        proceed.wait(30)
        yield like

    snap.hold()
    snap.prepare(layout(), lambda: done.append("waited"))
    assert first.wait(30)
    waiter = threading.Thread(target=snap.wait)
    waiter.start()
    snap.hold()  # another hold while (or before) the waiter waits
    proceed.set()
    waiter.join(30)
    assert not waiter.is_alive() and done == ["waited"]

    first.clear()
    snap.prepare(layout(), lambda: done.append("cleared"))  # still held
    assert first.wait(30)
    snap.clear()  # returns: the held preparation stops before its next buffer
    assert done == ["waited"] and snap.state == "empty"
