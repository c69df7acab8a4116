"""The engine on CPU: replicas stay identical, warmup precedes worker threads, no runtime
compiles, shapes are guarded, cancel/failure/resume behave."""

import threading

import pytest
import torch

from dflash_core.checkpoint import load_weights
from dflash_core.config import ShapeConfig
from dflash_core.defaults import DEFAULT_DRAFTER_LAYERS, DEFAULT_SHAPE_CPU, DEFAULT_TARGET_LAYER_IDS
from dflash_core.engine import Engine, EngineConfig, JobCallbacks, JobError, TrainJob
from tests.helpers import train_spec

SMALL = ShapeConfig(seq_len=256, num_anchors=32, block_size=8)


def engine_config(devices, shape=SMALL, **kw):
    return EngineConfig(
        drafter_devices=devices,
        seq_len=shape.seq_len,
        num_anchors=shape.num_anchors,
        block_size=shape.block_size,
        drafter_layers=DEFAULT_DRAFTER_LAYERS,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
        **kw,
    )


def make_engine(data_dir, devices, shape=SMALL, on_phase=None):
    return Engine(engine_config(devices, shape), data_dir, on_phase=on_phase).build()


def thread_names(engine):
    return [label for label, _ in engine.build_timeline() if label.startswith("thread:")]


def job(default_assets, out, **kw):
    spec = train_spec(default_assets, out, 12, checkpoint_interval=1000)
    spec.update(kw)
    return TrainJob(**spec)


class Recorder(JobCallbacks):
    def __init__(self, cancel_after=None):
        self.steps, self.events, self.cancel_after = [], [], cancel_after

    def on_step(self, stats):
        self.steps.append(stats)

    def on_event(self, kind, payload):
        self.events.append((kind, payload))

    def should_cancel(self):
        return self.cancel_after is not None and len(self.steps) >= self.cancel_after


def params_of(rep):
    return [p.detach().clone() for p in rep.drafter.parameters()]


@pytest.fixture(scope="module")
def data_dir(default_assets):
    return default_assets.root.parent.parent


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_identical_and_equal_to_single_replica(data_dir, default_assets, tmp_path, replicas):
    multi = make_engine(data_dir, ["cpu"] * replicas)
    rec = Recorder()
    multi.run_job(job(default_assets, tmp_path / "multi", steps=10), rec)
    first = params_of(multi.replicas[0])
    for rep in multi.replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, params_of(rep))), "replicas diverged"
    assert sum(s.loss for s in rec.steps[-3:]) < sum(s.loss for s in rec.steps[:3])
    multi.close()

    single = make_engine(data_dir, ["cpu"])
    rec1 = Recorder()
    single.run_job(job(default_assets, tmp_path / "single", steps=10, grad_accum=replicas), rec1)
    for s_multi, s_single in zip(rec.steps, rec1.steps):
        assert abs(s_multi.loss - s_single.loss) < 1e-4 * s_single.loss
        assert s_multi.context_tokens == s_single.context_tokens
    # Adam normalizes updates, so fp32 rounding in the summation order shows up at a small
    # fraction of one learning-rate step (lr = 3e-3), never more.
    for a, b in zip(first, params_of(single.replicas[0])):
        assert (a - b).abs().max() < 1e-4
    single.close()


def test_warmup_precedes_worker_threads_and_progress_is_monotone(data_dir):
    seen = []
    engine = make_engine(data_dir, ["cpu", "cpu"], on_phase=seen.append)
    names = [n for n, _ in engine.build_timeline()]
    last_warm = max(i for i, n in enumerate(names) if n.startswith("warmup:drafter:"))
    first_thread = min(i for i, n in enumerate(names) if n.startswith("thread:"))
    assert names.index("warmup:done") < first_thread and last_warm < first_thread
    ready = [p.drafters_ready for p in seen]
    assert ready == sorted(ready) and ready[-1] == seen[-1].drafters_total == 2
    assert seen[-1].phase == "ready" and [p.elapsed_seconds for p in seen] == sorted(p.elapsed_seconds for p in seen)
    timeline = engine.build_timeline()  # where time to ready went, in order
    labels = [label for label, _ in timeline]
    for earlier, later in (
        ("build:tokenizer_and_config", "build:cuda_contexts"),
        ("build:cuda_contexts", "build:target_loaded:cpu"),
        ("build:target_loaded:cpu", "build:replica_created:cpu"),
        ("build:weights_initialized", "build:drafter_step:cpu"),
        ("build:drafter_step:cpu", "warmup:drafter:cpu"),
        ("warmup:drafter:cpu", "warmup:done"),
    ):
        assert labels.index(earlier) < labels.index(later)
    assert [t for _, t in timeline] == sorted(t for _, t in timeline)
    engine.close()


def test_no_compile_after_warmup_and_other_shapes_refused(data_dir, default_assets, tmp_path):
    engine = make_engine(data_dir, ["cpu"])
    before = engine.status().compiles
    engine.run_job(job(default_assets, tmp_path, steps=3), Recorder())
    assert engine.status().compiles["runtime"] == 0 == before["runtime"]
    with pytest.raises(JobError) as e:
        engine.validate_job(job(default_assets, tmp_path, block_size=16))
    assert e.value.field == "block_size" and "block_size=8" in str(e.value)
    with pytest.raises(JobError):
        engine.run_job(job(default_assets, tmp_path, seq_len=1024))
    engine.close()


def test_fail_on_recompile_holds_in_worker_threads():
    """The guard the engine sets after a compiled warmup: a new shape raises in another thread."""
    from dflash_core.engine.compile import CompileGuard

    guard = CompileGuard()
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
    fn(torch.randn(8))
    guard.end_warmup(enforce=True)
    errors, results = [], []

    def worker(n):
        try:
            results.append(fn(torch.randn(n)).shape[0])
        except RuntimeError as e:
            errors.append(str(e))

    try:
        for n in (8, 16):
            t = threading.Thread(target=worker, args=(n,))
            t.start()
            t.join()
    finally:
        guard.release()
    assert results == [8]
    assert len(errors) == 1 and "recompile" in errors[0].lower()
    assert guard.counts()["runtime"] == 0


@pytest.mark.slow  # several jobs on one engine, one cancelled and one failing
def test_cancel_failure_and_recovery(data_dir, default_assets, tmp_path, monkeypatch):
    engine = make_engine(data_dir, ["cpu", "cpu"])
    rec = Recorder(cancel_after=2)
    res = engine.run_job(job(default_assets, tmp_path / "cancel", steps=50), rec)
    assert res.status == "STOPPED" and res.steps_done == 2 and len(rec.steps) == 2
    assert res.final_checkpoint and res.final_checkpoint.endswith("step-00000002")

    # A fault inside one drafter thread fails the job with a readable reason...
    victim = engine.replicas[1]
    real = victim.forward_backward

    def broken(*a, **k):
        raise RuntimeError("injected drafter fault")

    monkeypatch.setattr(victim, "forward_backward", broken)
    with pytest.raises(JobError, match="injected drafter fault"):
        engine.run_job(job(default_assets, tmp_path / "fail", steps=5), Recorder())
    monkeypatch.setattr(victim, "forward_backward", real)
    # ...and the same warm engine runs the next job to completion, without compiling.
    res = engine.run_job(job(default_assets, tmp_path / "after", steps=4), Recorder())
    assert res.status == "SUCCEEDED" and res.steps_done == 4
    assert engine.status().compiles["runtime"] == 0
    engine.close()


@pytest.mark.slow  # trains the same job twice, once interrupted
@pytest.mark.parametrize("replicas", [1, 2])
def test_resume_matches_uninterrupted_run(data_dir, default_assets, tmp_path, replicas):
    engine = make_engine(data_dir, ["cpu"] * replicas)
    full = engine.run_job(
        job(default_assets, tmp_path / "full", steps=20, checkpoint_interval=10, keep_checkpoints=5), Recorder()
    )
    half = tmp_path / "full" / "checkpoints" / "step-00000010"
    rec = Recorder()
    resumed = engine.run_job(
        job(default_assets, tmp_path / "resumed", steps=20, checkpoint_interval=10), rec, resume_from=str(half)
    )
    assert [s.step for s in rec.steps] == list(range(11, 21))
    a = load_weights(full.final_checkpoint, DEFAULT_DRAFTER_LAYERS)
    b = load_weights(resumed.final_checkpoint, DEFAULT_DRAFTER_LAYERS)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    first = params_of(engine.replicas[0])
    for rep in engine.replicas[1:]:  # each replica resumed with its own optimizer state
        assert all(torch.equal(x, y) for x, y in zip(first, params_of(rep)))
    engine.close()


@pytest.mark.slow  # fifty training steps
def test_fifty_steps_lower_the_loss_on_the_embedded_default(data_dir, default_assets, tmp_path):
    engine = make_engine(data_dir, ["cpu"], shape=DEFAULT_SHAPE_CPU)
    rec = Recorder()
    res = engine.run_job(job(default_assets, tmp_path, steps=50, learning_rate=3e-3), rec)
    assert res.status == "SUCCEEDED"
    first = sum(s.loss for s in rec.steps[:5]) / 5
    last = sum(s.loss for s in rec.steps[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert all(s.context_tokens > 0 for s in rec.steps)
    engine.close()


@pytest.mark.slow  # builds a second engine with two target workers
def test_two_target_workers_give_the_same_result(data_dir, default_assets, tmp_path):
    """One target worker per target device; each replica is fed by one worker, in order."""
    results = []
    for targets in (["cpu"], ["cpu", "cpu"]):
        engine = Engine(engine_config(["cpu", "cpu"], target_devices=targets), data_dir).build()
        engine.run_job(job(default_assets, tmp_path / str(len(targets)), steps=4, grad_accum=2), Recorder())
        assert sum(n.startswith("thread:target-") for n in thread_names(engine)) == len(targets)
        results.append(params_of(engine.replicas[0]))
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_failing_target_worker_fails_the_job_without_hanging(data_dir, default_assets, tmp_path, monkeypatch):
    engine = make_engine(data_dir, ["cpu", "cpu"])
    target = engine.targets[0]
    calls = {"n": 0}
    real = target.capture

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected target fault")
        return real(*a, **k)

    monkeypatch.setattr(target, "capture", flaky)
    with pytest.raises(JobError, match="injected target fault"):
        engine.run_job(job(default_assets, tmp_path / "f", steps=20, grad_accum=2), Recorder())
    monkeypatch.setattr(target, "capture", real)
    assert engine.run_job(job(default_assets, tmp_path / "ok", steps=2), Recorder()).status == "SUCCEEDED"
    engine.close()


class CheckpointRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.checkpoints, self.removed, self.pauses = [], [], []

    def on_checkpoint(self, path, step, pause_seconds=0.0):
        self.checkpoints.append((path, step, len(self.steps)))
        self.pauses.append(pause_seconds)

    def on_checkpoints_removed(self, paths):
        self.removed += paths


def test_a_job_reports_where_its_time_before_the_first_step_went(data_dir, default_assets, tmp_path):
    """One `first_step` event per job, after its first step: seconds per phase from the job's
    start (data, plan, start state, checkpointer, pipeline, the first step) and their total."""
    engine = make_engine(data_dir, ["cpu"])
    rec = Recorder()
    assert engine.run_job(job(default_assets, tmp_path / "first", steps=3), rec).status == "SUCCEEDED"
    first = [payload["seconds"] for kind, payload in rec.events if kind == "first_step"]
    assert len(first) == 1
    phases = first[0]
    assert list(phases) == [
        "data_open",
        "batch_plan",
        "start_state",
        "checkpointer",
        "pipeline_start",
        "first_step",
        "total",
    ]
    assert all(v >= 0 for v in phases.values()) and phases["first_step"] > 0
    assert abs(sum(v for k, v in phases.items() if k != "total") - phases["total"]) < 0.01
    engine.close()


def test_checkpoints_written_beside_training_and_reported_once_complete(data_dir, default_assets, tmp_path):
    """Checkpoints are written on the writer thread from a snapshot: each is reported once, in
    order, only after its directory exists, and holds the weights of its own step even though
    training went on while it was written."""
    from dflash_core.checkpoint import load_training_state, load_weights

    engine = make_engine(data_dir, ["cpu"])
    rec = CheckpointRecorder()
    res = engine.run_job(
        job(default_assets, tmp_path / "ckpts", steps=6, checkpoint_interval=2, keep_checkpoints=5), rec
    )
    assert res.status == "SUCCEEDED"
    assert [s for _, s, _ in rec.checkpoints] == [2, 4, 6]
    assert all(seen >= s for _, s, seen in rec.checkpoints)  # never reported before its step ran
    assert res.final_checkpoint == rec.checkpoints[-1][0]
    final = dict(engine.replicas[0].drafter.state_dict())
    at_4 = load_weights(rec.checkpoints[1][0], DEFAULT_DRAFTER_LAYERS)
    at_6 = load_weights(rec.checkpoints[2][0], DEFAULT_DRAFTER_LAYERS)
    assert all(torch.equal(at_6[k], final[k]) for k in final)
    assert any(not torch.equal(at_4[k], final[k]) for k in final)  # the step-4 snapshot was not overwritten
    assert load_training_state(rec.checkpoints[1][0])["step"] == 4
    # rotation keeps the newest keep_checkpoints, and deletes only after the newer one is reported
    rec = CheckpointRecorder()
    res = engine.run_job(
        job(default_assets, tmp_path / "rotated", steps=6, checkpoint_interval=2, keep_checkpoints=2), rec
    )
    on_disk = sorted(p.name for p in (tmp_path / "rotated" / "checkpoints").iterdir())
    assert on_disk == ["step-00000004", "step-00000006"] and [s for _, s, _ in rec.checkpoints] == [2, 4, 6]
    assert [p.rsplit("/", 1)[-1] for p in rec.removed] == ["step-00000002"]  # reported, for the job store
    engine.close()


def test_checkpoint_that_cannot_be_written_fails_the_job(data_dir, default_assets, tmp_path):
    engine = make_engine(data_dir, ["cpu"])
    out = tmp_path / "blocked"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoint directory goes\n")
    rec = Recorder()
    with pytest.raises(JobError, match=r"output_dir .*'checkpoints' is not a plain directory") as err:
        engine.run_job(job(default_assets, out, steps=4, checkpoint_interval=2), rec)
    assert err.value.field == "output_dir" and rec.steps == []  # refused before training, not at the first checkpoint
    # the engine is not left half-busy: the next job runs
    res = engine.run_job(job(default_assets, tmp_path / "next", steps=2), Recorder())
    assert res.status == "SUCCEEDED"
    engine.close()


def test_writes_and_deletions_stay_under_the_output_roots(data_dir, default_assets, tmp_path):
    """A job's output directory swapped for symlinks after submission: a `checkpoints` symlink
    pointing outside the roots is refused before training, and rotation deletes a symlink named
    like an old checkpoint without following it."""
    engine = make_engine(data_dir, ["cpu"])
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "out").mkdir(parents=True)
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    (root / "out" / "checkpoints").symlink_to(outside)
    spec = job(default_assets, root / "out", steps=2, checkpoint_interval=1, output_roots=[str(root)])
    with pytest.raises(JobError, match="not a plain directory"):
        engine.run_job(spec, Recorder())
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    (root / "out" / "checkpoints").unlink()
    (root / "out" / "checkpoints").mkdir()
    (root / "out" / "checkpoints" / "step-00000000").symlink_to(outside)  # sorts before the real ones
    (root / "out" / "checkpoints" / ".tmp-step-00000007-deadbeef").mkdir()  # a crash mid-write
    spec = job(
        default_assets, root / "out", steps=3, checkpoint_interval=1, keep_checkpoints=2, output_roots=[str(root)]
    )
    assert engine.run_job(spec, Recorder()).status == "SUCCEEDED"
    assert sorted(p.name for p in (root / "out" / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    assert (outside / "precious.txt").read_text() == "keep me\n"
    engine.close()


def test_reads_stay_under_the_dataset_roots(data_dir, default_assets, tmp_path):
    """A dataset swapped for a symlink to a file outside the roots after submission is not read;
    the error names the path as given, not the file's content."""
    engine = make_engine(data_dir, ["cpu"])
    root, secret = tmp_path / "datasets", tmp_path / "secret.jsonl"
    root.mkdir()
    secret.write_text('{"messages": [{"role": "user", "content": "TOP-SECRET"}]}\n')
    (root / "data.jsonl").symlink_to(secret)
    spec = job(default_assets, tmp_path / "out", steps=2, dataset_roots=[str(root)])
    spec.datasets = [str(root / "data.jsonl")]
    with pytest.raises(JobError, match="outside the allowed roots") as err:
        engine.run_job(spec, Recorder())
    assert "TOP-SECRET" not in str(err.value) and str(secret) not in str(err.value)
    engine.close()


def test_read_only_and_full_output_dirs_are_refused_at_submission(data_dir, default_assets, tmp_path):
    """validate_job (what the service runs at submission) names ENOSPC and read-only output
    directories before anything trains; a checkpoint that would not fit is refused before writing."""
    from tests.helpers import mount_tmpfs, unmount

    engine = make_engine(data_dir, ["cpu"])
    ro, small = tmp_path / "ro", tmp_path / "small"
    mount_tmpfs(ro, "size=1m,ro")
    try:
        mount_tmpfs(small, "size=64k")
        try:
            with pytest.raises(JobError, match="read-only") as err:
                engine.validate_job(job(default_assets, ro / "out"))
            assert err.value.field == "output_dir"
            with pytest.raises(JobError, match="ENOSPC") as err:
                engine.validate_job(job(default_assets, small / "out"))
            assert err.value.field == "output_dir"
        finally:
            unmount(small)
    finally:
        unmount(ro)
    engine.close()


def test_a_failing_replica_with_gradient_accumulation_does_not_hang_the_job(
    data_dir, default_assets, tmp_path, monkeypatch
):
    """One target worker feeding two replicas, a long accumulation: when one replica fails, the
    other (waiting for micro-batches queued behind the failed one's) fails too, instead of hanging."""
    engine = make_engine(data_dir, ["cpu", "cpu"])
    victim = engine.replicas[0]

    def broken(*a, **k):
        raise RuntimeError("injected replica fault")

    monkeypatch.setattr(victim, "forward_backward", broken)
    result: list = []

    def run():
        try:
            engine.run_job(job(default_assets, tmp_path / "hang", steps=3, grad_accum=8), Recorder())
        except JobError as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the job hung after a replica failed"
    assert result and "injected replica fault" in str(result[0])
    monkeypatch.undo()
    engine.close()


def test_a_job_holds_the_engines_pinning_through_its_first_step(tmp_path, default_assets):
    """The checkpoint buffers the engine pins from ready on (a CPU engine has none to pin, so
    the test gives it a snapshot): a job holds their preparation from its start to its first
    step's checkpoint call, and the preparation goes on after it."""
    from dflash_core.engine.host_snapshot import HostSnapshot

    engine = make_engine(tmp_path / "data", ["cpu"])
    snap = HostSnapshot()
    engine.parts.snapshot = snap
    held_at_steps = []

    class Watch(Recorder):
        def on_step(self, stats):
            super().on_step(stats)
            held_at_steps.append(snap._held)  # on_step comes before the step's checkpoint call

    rec = Watch()
    res = engine.run_job(job(default_assets, tmp_path / "out", steps=3), rec)
    assert res.status == "SUCCEEDED", res.error
    assert held_at_steps == [True, False, False] and not snap._held
    engine.close()


def test_a_continual_job_waiting_for_data_lets_the_pinning_go_on(tmp_path, default_assets):
    """A continual job with no records yet holds the engine's pinning only until it starts
    waiting for data: then it lets the preparation go on (it could wait for hours)."""
    from dflash_core.continual.job import ContinualJob
    from dflash_core.engine.host_snapshot import HostSnapshot

    engine = make_engine(tmp_path / "data", ["cpu"])
    snap = HostSnapshot()
    engine.parts.snapshot = snap
    source = tmp_path / "records"
    source.mkdir()
    seen = []

    class Watch(Recorder):
        def should_cancel(self):
            seen.append(snap._held)
            # stop once it has let go (or, were it never to, after a few seconds of polls)
            return (not snap._held and len(seen) > 1) or len(seen) > 300

    spec = ContinualJob(
        datasets=[], sources=[str(source)], output_dir=str(tmp_path / "out"), poll_seconds=0.05, seq_len=256
    )
    rec = Watch()
    res = engine.run_job(spec, rec)
    assert res.status == "STOPPED", res.error
    assert seen[0] is True and seen[-1] is False, seen[:3]  # held as it began, let go while waiting
    assert not rec.steps
    engine.close()
