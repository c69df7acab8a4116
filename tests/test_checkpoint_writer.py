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


def test_pinned_buffers_are_carved_from_power_of_two_slabs_each_a_tensor_of_its_own(tmp_path):
    """PinnedSlabs, pageable here (the carving is the same as pinned): the fp32 masters and two
    moments of a drafter-like layout, scaled down with the slab (matrices of 1/4, 1/16, 3/4 and
    5/4 slabs and vectors, as the reference drafter's to 256 MiB), take slabs whose sizes are
    powers of two and whose sum is within 6 % of the buffers' bytes (a small state's slabs grow
    from its first buffer's size), where one power-of-two
    allocation per buffer (what torch's pinned allocator does) takes over a quarter more. Every
    buffer is a tensor with a storage of its own, of its exact size, overlapping no other, and
    outlives the slabs' owner; safetensors and torch.save write each at its own size and read
    back what was written."""
    import gc
    import itertools
    import os

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_core.engine.host_snapshot import PinnedSlabs

    slab = 1 << 20
    layer = [(256, 256), (64, 256), (64, 256), (256, 256), (768, 256), (768, 256), (256, 768), (256,), (256,)]
    masters = [(1280, 256), (256,)] + layer * 5  # fc (5/4 of a slab), its norm, five layers
    shapes = masters + [s for s in masters for _ in range(2)]
    slabs = PinnedSlabs(pin=False, slab_bytes=slab)
    buffers = [slabs.take(torch.Size(s), torch.float32) for s in shapes]
    extra = [slabs.take(torch.Size([3, 5]), torch.bfloat16), slabs.take(torch.Size([]), torch.float32)]
    empty = slabs.take(torch.Size([0, 4]), torch.float32)
    assert empty.shape == (0, 4)
    small = PinnedSlabs(pin=False, slab_bytes=slab)  # a small state: slabs grow from its first buffer
    for n in (1000, 5000, 30000, 2000):
        small.take(torch.Size([n]), torch.float32)
    assert [len(raw) for raw, _ in small._slabs] == [4096, 32768, 131072] and small.nbytes < 2 * 4 * 38000

    exact = sum(t.numel() * 4 for t in buffers)
    each_rounded = sum(1 << (t.numel() * 4 - 1).bit_length() for t in buffers)
    sizes = [len(raw) for raw, _ in slabs._slabs]
    assert set(sizes) == {slab, 2 * slab}, sizes  # the powers of two that hold fc's 5/4 and the rest
    assert each_rounded > 1.25 * exact  # what one pinned allocation per buffer would hold
    assert slabs.nbytes == sum(sizes) <= 1.06 * exact, (slabs.nbytes, exact)

    everything = buffers + extra
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in everything)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges)), "buffers overlap"
    for t in everything:
        assert t.untyped_storage().data_ptr() == t.data_ptr()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    for i, t in enumerate(everything):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + i)
    del slabs
    gc.collect()
    for i, t in enumerate(everything):  # still there, each its own values
        assert torch.equal(t, (torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + i).to(t.dtype)), i

    named = {f"b{i}": t for i, t in enumerate(everything[:12])} | {"bf16": extra[0]}
    clones = {k: v.clone() for k, v in named.items()}
    save_file(named, tmp_path / "carved.safetensors")
    save_file(clones, tmp_path / "cloned.safetensors")
    assert os.path.getsize(tmp_path / "carved.safetensors") == os.path.getsize(tmp_path / "cloned.safetensors")
    back = load_file(tmp_path / "carved.safetensors")
    assert all(torch.equal(back[k], v) for k, v in clones.items())
    torch.save({"state": everything}, tmp_path / "carved.pt")
    torch.save({"state": [t.clone() for t in everything]}, tmp_path / "cloned.pt")
    assert os.path.getsize(tmp_path / "carved.pt") == os.path.getsize(tmp_path / "cloned.pt")
    loaded = torch.load(tmp_path / "carved.pt")["state"]
    assert all(torch.equal(a, b) for a, b in zip(loaded, everything, strict=True))
