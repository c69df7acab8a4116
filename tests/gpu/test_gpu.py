"""GPU checks (marker gpu; skipped without CUDA): flex == dense forward and backward at the
reference widths, replicas identical across GPUs, no runtime compile over 50 steps, the engine's
Triton AdamW against torch's."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_flex_matches_dense_reference_widths():
    from bench.flex_vs_dense import run

    rows = {r["variant"]: r for r in run(layers=2, seq_len=3072, anchors=512)}
    dense = rows["dense_bf16"]
    # flex alone; the engine's CUDA step (compiled layers + mask, Triton CE loss chunks, its
    # default q_splits, bf16 working weights)
    for name in ("flex_bf16", "flex_layer_bf16"):
        flex = rows[name]
        assert float(flex["loss_rel"]) < 1e-2, name
        assert float(flex["hidden_rel"]) < 2e-2, name
        assert float(flex["grad_rel_max"]) < 5e-2, name
        # as close to the fp32 reference as SDPA in bf16 is (same function, same precision)
        assert float(flex["grad_rel_max"]) < 2 * float(dense["grad_rel_max"]) + 1e-2, name


def test_replicas_identical_and_no_runtime_compile(tmp_path):
    from bench.common import dims, random_target_engine_config, write_target_dir
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import Engine, JobCallbacks, TrainJob

    gpus = torch.cuda.device_count()
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cuda:0"]
    assets = ensure_default_assets(tmp_path / "data")
    target = write_target_dir(tmp_path / "target", **dims(1024, 3072, 8, 16, 8, 64), vocab_size=151936)
    cfg = random_target_engine_config(
        target, devices, 1024, 128, drafter_layers=2, inductor_cache_dir=str(tmp_path / "inductor")
    )
    engine = Engine(cfg, tmp_path / "data").build()
    warm = engine.status().compiles["warmup"]
    assert warm > 0  # flex was really compiled
    steps = []

    class CB(JobCallbacks):
        def on_step(self, s):
            steps.append(s)

    res = engine.run_job(
        TrainJob(
            datasets=[str(assets.train)],
            output_dir=str(tmp_path / "out"),
            steps=50,
            learning_rate=1e-3,
            checkpoint_interval=50,
        ),
        CB(),
    )
    assert res.status == "SUCCEEDED" and len(steps) == 50
    assert engine.status().compiles["runtime"] == 0
    labels = [label for label, _ in engine.build_timeline()]  # the checkpoint at step 50 waited for them
    # the snapshot's buffers pinned once the engine was ready, not beside its compiles
    assert labels.index("ready:checkpoint_buffers") > labels.index("warmup:done"), labels
    assert all(rep.step_graph is not None for rep in engine.replicas)  # the job replayed graphs
    first = [p.detach().cpu() for p in engine.replicas[0].drafter.parameters()]
    masters = {k: v.cpu() for k, v in engine.replicas[0].weights_state().items()}
    for rep in engine.replicas[1:]:
        assert all(torch.equal(a, b.detach().cpu()) for a, b in zip(first, rep.drafter.parameters()))
        # the fp32 masters too: bf16 working copies can agree while their masters differ
        assert all(torch.equal(masters[k], v.cpu()) for k, v in rep.weights_state().items())
    engine.close()  # also puts dynamo's stance back


def test_triton_adamw_matches_torch_adamw_on_cuda():
    from tests.adamw_check import compare
    from tests.test_optim import AGREEMENT

    # with two GPUs, on the one that is not current: the kernel must launch on the tensors' device
    diff = compare("cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0")
    assert diff["step_on_host"] and diff["loaded_step_on_host"] and diff["to_torch_keeps_its_implementation"]
    for key in AGREEMENT:
        assert diff[key] < 1e-6, (key, diff)
    from tests.adamw_check import working_copies_compare

    working = working_copies_compare("cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0")
    assert working["copies"] == 2 and working["masters"] < 1e-6 and working["exp_avg"] < 1e-6, working
    assert working["copy_ulps_from_rounded_master"] == 0.0, working  # rounded to nearest, as tensor.to(bf16)


def test_triton_ce_chunk_matches_eager_chunk_on_cuda():
    from tests.ce_check import compare

    device = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"  # not the current device, where possible
    diff = compare(device, rows=1920, hidden=4096, vocab=151936, dtype=torch.bfloat16)
    assert diff["loss_rel"] < 1e-4 and diff["grad_rel"] < 1e-2, diff  # bf16 gradient rounding
    assert diff["hit_mismatches"] == 0 and diff["tie_rows_first_index"] and diff["loss_only_same"], diff
    assert diff["hits"] > 0, diff


@pytest.mark.parametrize("micro_batches, replicas", [(1, 1), (2, 1), (1, 2)])
def test_bf16_working_weights_train_like_fp32_weights(micro_batches, replicas):
    """The engine's CUDA default (bf16 working copies of the weight matrices, fp32 masters)
    against fp32 weights under autocast: the GEMMs see the same bf16 values and the gradients are
    the same bf16 products, so two clipped steps (one or two micro-batches each, or two replicas
    averaged by GradSync; sums and means in fp32) leave the same masters; every copy is its
    master rounded to bf16."""
    from dflash_core.config import ShapeConfig
    from dflash_core.data.batches import synthetic_micro_batch
    from dflash_core.drafter import FrozenHead
    from dflash_core.engine.config import StepPlan
    from dflash_core.engine.drafters import GradSync
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep
    from tests.helpers import tiny_drafter_config

    cfg = tiny_drafter_config(vocab_size=512, block_size=8, hidden=256, heads=4, kv_heads=2, layers=2)
    shape = ShapeConfig(seq_len=256, num_anchors=16, block_size=8)
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(512, 256, device="cuda", generator=g), torch.randn(512, 256, device="cuda", generator=g) * 0.05
    )
    n = micro_batches * replicas
    feats = [torch.randn(256, 2 * 256, device="cuda", generator=g) for _ in range(n)]
    batches = [synthetic_micro_batch(shape, 512, 0, seed=i).to("cuda") for i in range(n)]
    reps, losses = {}, {}
    for mode in ("fp32", "bf16"):
        plan = StepPlan(attention="dense", compiled=False, loss="triton", working_weights=mode)
        group = [DrafterReplica(i, cfg, "cuda:0", head, plan, ReplicaStep(4.0, 64)) for i in range(replicas)]
        for rep in group:
            rep.init_weights(3)
            rep.new_optimizer(1e-3, 0.1, (0.9, 0.95))
            rep.sum_grads_in_fp32 = n > 1  # as the engine sets it
        losses[mode] = []
        for _ in range(2):
            accs = [rep.new_accumulator() for rep in group]
            for k, (batch, f) in enumerate(zip(batches, feats)):
                r = k // micro_batches
                group[r].forward_backward(batch, f, 1.0 / micro_batches, accs[r])
            GradSync().average([rep.grads() for rep in group])
            for rep in group:
                rep.clip_and_step(0.5, 1e-3)
            losses[mode].append(sum(float(a.loss_sum) for a in accs))
        reps[mode] = group[0]
    fp32, bf16 = reps["fp32"], reps["bf16"]
    assert sum(c is not None for c in bf16.working_copies()) == 2 * 7 + 1  # 7 matrices per layer + fc
    assert all(p.dtype == torch.bfloat16 for p in bf16.params if p.dim() >= 2)
    for (name, a), (_, b) in zip(fp32.named_masters(), bf16.named_masters()):
        assert b.dtype == torch.float32
        rel = float((a - b).norm() / a.norm())
        assert rel < 1e-5, (name, rel)
    for m, p in zip(bf16.masters, bf16.params):
        assert torch.equal(p.detach(), m.detach().to(p.dtype)), "working copy is not its master rounded"
    assert losses["fp32"] == pytest.approx(losses["bf16"], rel=1e-5)


def test_checkpoint_snapshot_is_one_steps_state_and_reuses_its_buffers():
    """HostSnapshot: device tensors copied asynchronously into pinned buffers that the next
    snapshot reuses; an in-place write ordered after the copy event (as the replica's next
    optimizer step is, by its write guard) does not reach the snapshot."""
    from dflash_core.engine.host_snapshot import HostSnapshot

    snap = HostSnapshot()
    snap.prepare([(torch.Size([4096, 4096]), torch.float32, torch.device("cuda:0"))])
    w, b = torch.randn(4096, 4096, device="cuda"), torch.randn(1000, device="cuda")
    state = {"w": w, "b": b, "step": torch.tensor(3.0)}
    before = w.clone()
    (copy, event) = snap.copy(state)  # b: a buffer carved where none was prepared
    torch.cuda.current_stream().wait_event(event)  # the write guard
    w.mul_(2)  # the next optimizer step
    event.synchronize()
    assert torch.equal(copy["w"], before.cpu()) and copy["w"].is_pinned() and copy["step"].item() == 3.0
    assert torch.equal(copy["b"], b.cpu()) and copy["b"].is_pinned()
    assert snap.pinned_bytes == (64 + 128) << 20  # w's slab, then one twice its size
    ptr = copy["w"].data_ptr()
    (again, event) = snap.copy(state)
    event.synchronize()
    assert again["w"].data_ptr() == ptr and torch.equal(again["w"], w.cpu())


def test_target_cuda_graph_reproduces_the_eager_capture(tmp_path):
    """The target's capture recorded as a CUDA graph gives the eager features bit for bit, for
    micro-batches other than the one it was recorded with, and its output buffer is reused."""
    from bench.common import dims, write_target_dir
    from dflash_core.config import ShapeConfig
    from dflash_core.data.batches import synthetic_micro_batch
    from dflash_core.target import TargetModel

    path = write_target_dir(tmp_path / "target", **dims(512, 1536, 6, 8, 4, 64), vocab_size=4096)
    target = TargetModel(path, [1, 3, 5], "cuda:0", random_init=True)
    shape = ShapeConfig(seq_len=512, num_anchors=32, block_size=16)
    assert target.record_graph(shape.seq_len)
    outputs = []
    for seed in (1, 2, 3):
        mb = synthetic_micro_batch(shape, 4096, 0, seed=seed)
        args = [t.to("cuda:0") for t in (mb.input_ids, mb.position_ids, mb.doc_ids)]
        eager = target._capture(*args)
        graphed = target.capture(*args)
        outputs.append(graphed.data_ptr())
        assert torch.equal(graphed, eager), seed
    assert len(set(outputs)) == 1  # one output buffer: the caller copies features out


def test_step_graph_trains_like_the_eager_step():
    """A replica replaying its recorded micro-step ends every step bit-identical to a twin that
    steps eagerly: one micro-batch per step, then two summed in fp32 (gradient accumulation),
    then another gamma; other micro-batches than the recorded one, the engine's CUDA plan."""
    from dflash_core.config import ShapeConfig
    from dflash_core.data.batches import synthetic_micro_batch
    from dflash_core.drafter import FrozenHead
    from dflash_core.engine.config import step_plan
    from dflash_core.engine.replica import DrafterReplica, ReplicaStep
    from dflash_core.engine.step_graph import StepGraph, matches_eager
    from tests.helpers import tiny_drafter_config

    cfg = tiny_drafter_config(vocab_size=4096, block_size=16, hidden=256, heads=4, kv_heads=2, layers=2)
    shape = ShapeConfig(seq_len=512, num_anchors=32, block_size=16)
    g = torch.Generator(device="cuda").manual_seed(0)
    head = FrozenHead(
        torch.randn(4096, 256, device="cuda", generator=g), torch.randn(4096, 256, device="cuda", generator=g) * 0.05
    )
    plan = step_plan(["cuda:0"])
    graphed, eager = (DrafterReplica(i, cfg, "cuda:0", head, plan, ReplicaStep(7.0, 128)) for i in range(2))
    batches = [synthetic_micro_batch(shape, 4096, 0, seed=i).to("cuda") for i in range(12)]
    feats = [torch.randn(512, 2 * 256, device="cuda", generator=g).bfloat16() for _ in batches]
    for rep in (graphed, eager):
        rep.init_weights(3)
    graph = StepGraph(graphed, batches[0], feats[0])
    assert graph.grads[0].data_ptr() != 0
    assert matches_eager(graph, graphed, batches[1], feats[1])
    graphed.step_graph = graph
    for rep in (graphed, eager):
        rep.new_optimizer(1e-3, 0.1, (0.9, 0.95))
    k = 0
    for accum, gamma in ((1, 7.0), (1, 7.0), (2, 7.0), (2, 4.0), (1, 4.0)):
        stats = []
        for rep in (graphed, eager):
            rep.gamma, rep.sum_grads_in_fp32 = gamma, accum > 1
            acc = rep.new_accumulator()
            for j in range(accum):
                rep.forward_backward(batches[k + j], feats[k + j], 1.0 / accum, acc, graphed=rep is graphed)
            rep.clip_and_step(0.5, 1e-3)
            stats.append((acc.loss_sum.clone(), acc.correct.clone(), acc.counted.clone()))
        k += accum
        for a, b in zip(*stats):
            assert torch.equal(a, b), (accum, gamma)
        for (name, a), (_, b) in zip(graphed.named_masters(), eager.named_masters()):
            assert torch.equal(a, b), (name, accum, gamma)
        for a, b in zip(graphed.params, eager.params):
            assert torch.equal(a, b)
    # a step never mixes replayed and eager micro-batches (their gradients live apart), and a
    # replayed step of several micro-batches needs the fp32 sums
    graphed.sum_grads_in_fp32 = False
    acc = graphed.new_accumulator()
    graphed.forward_backward(batches[0], feats[0], 0.5, acc)
    with pytest.raises(RuntimeError, match="recorded shapes"):
        graphed.forward_backward(batches[1], feats[1], 0.5, acc, graphed=False)
    with pytest.raises(RuntimeError, match="sums them in fp32"):
        graphed.forward_backward(batches[1], feats[1], 0.5, acc)
    graphed.zero_grad()
