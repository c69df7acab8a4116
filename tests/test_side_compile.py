"""The drafter compile beside the target (dflash_core/engine/side_compile.py): a child process
builds a replica from its spec and warms it on stand-ins; the build gets back what it did, stops a
child that outlasts its bound, and starts none where the compile cache has seen the drafter warmed
or the target's size is unknown. The compile itself, and the build's hits on what the child
compiled, need CUDA: tests/gpu/test_side_compile_gpu.py."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash_core.config import DrafterConfig, ShapeConfig
from dflash_core.engine.config import CPU_PLAN
from dflash_core.engine.replica import ReplicaStep
from dflash_core.engine.side_compile import (
    SideCompile,
    SideCompiles,
    SideSpec,
    drafter_specs,
    marker,
    note_warmed,
    target_bytes_by_device,
)
from tests.helpers import REPO_ROOT as REPO
from tests.helpers import run_code


def tiny_spec(devices: tuple[str, ...] = ("cpu",), **changes) -> SideSpec:
    drafter = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        block_size=4,
        mask_token_id=5,
        target_layer_ids=(0, 1),
        num_target_layers=2,
    )
    shape = ShapeConfig(seq_len=64, num_anchors=4, block_size=4)
    spec = drafter_specs(drafter, shape, CPU_PLAN, ReplicaStep(4.0, 2048), 0, list(devices), torch.float32)[0]
    return dataclasses.replace(spec, **changes)


def test_a_child_warms_a_replica_from_its_spec():
    """The spec travels to a fresh interpreter, which builds the replica and runs the warm-up's
    step on a random head and random features of the target's width (two captured layers), with
    its spec's share of the cores for inductor's worker pool (applied before the first compile
    starts the pool)."""
    spec = tiny_spec(compile_threads=3)
    assert spec.features == (64, 128) and spec.dtype == "float32"
    child = SideCompile.start("cpu")
    child.send(spec)
    result = child.wait()
    assert result["ok"], result
    assert result["device"] == "cpu" and result["step_graph"] is False and result["seconds"] > 0
    assert result["compile_threads"] == 3, result
    # where the child's time went: the warm-up's step ran, no step graph was recorded on the CPU
    assert result["warm_s"] > 0 and result["setup_s"] >= 0 and result["record_s"] < result["warm_s"]


def test_a_failed_child_and_a_stuck_one_come_back_as_results():
    failing = SideCompile.start("cpu")
    failing.send(tiny_spec(dtype="no_such_dtype"))
    bad = failing.wait()
    assert not bad["ok"] and "no_such_dtype" in bad["error"], bad
    stuck = SideCompile.start("cpu")
    stuck.send(tiny_spec())
    result = stuck.wait(bound=0.2)  # importing torch alone takes longer
    assert not result["ok"] and "stopped" in result["error"], result
    assert stuck.proc.returncode is not None  # killed and reaped, not left running


def test_the_build_stops_its_children():
    """What the build does when it fails before it waits for them (an exception in the target's
    load, say): no child keeps compiling."""
    side = SideCompiles.start(["cpu", "cpu"])
    assert len(side.children) == 1  # replicas that share a device share its graphs
    side.stop()
    assert side.children[0].proc.returncode is not None


# a stand-in build: starts a process that watches it as a child does, prints that pid, then sleeps
# until the test kills it
ORPHANED = """
import os, subprocess, sys
watcher = "import sys, time; from dflash_core.engine.side_compile_child import exit_with_parent; " \\
    "exit_with_parent(int(sys.argv[1])); time.sleep(120)"
proc = subprocess.Popen([sys.executable, "-c", watcher, str(os.getpid())])
print(proc.pid, flush=True)
import time; time.sleep(120)
"""


def test_a_child_exits_when_its_build_dies(tmp_path):
    """SIGKILL leaves no build to stop a child: the child notices its parent is gone and exits."""
    build = subprocess.Popen([sys.executable, "-c", ORPHANED], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert build.stdout is not None
    child = int(build.stdout.readline())
    time.sleep(0.5)  # the child has started watching (or will find its parent gone at once)
    assert alive(child)
    build.send_signal(signal.SIGKILL)
    build.wait()
    deadline = time.monotonic() + 60  # the watch polls every second; the child still imports torch
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(child)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # an exited orphan is reaped by init; until then it is a zombie, which has stopped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False


def test_one_child_per_device_and_markers_keyed_by_what_the_graphs_depend_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    specs = [tiny_spec(("cpu", "cpu"))]
    [shared] = drafter_specs_of(("cpu", "cpu"))  # replicas sharing a device share its graphs
    assert shared.drafter_devices == 2 and shared.replica_index == 0  # the build's recompile limit
    spec = specs[0]
    same = dataclasses.replace(
        spec,
        replica_index=3,
        memory_fraction=0.5,
        drafter_devices=3,  # dynamo's recompile limit, not the graphs
        drafter={**spec.drafter, "mask_token": "<m>", "input_embedding_scale": 8.0},
    )
    assert spec.key() == same.key()
    for other in (
        dataclasses.replace(spec, shape={**spec.shape, "seq_len": 128}),
        dataclasses.replace(spec, plan={**spec.plan, "precision": "fp8"}),
        dataclasses.replace(spec, teacher=True),
        dataclasses.replace(spec, dtype="bfloat16"),
        dataclasses.replace(spec, drafter={**spec.drafter, "num_hidden_layers": 2}),
    ):
        assert other.key() != spec.key(), other
    assert not marker(spec).exists()
    note_warmed(spec)
    assert marker(spec).is_file() and tmp_path in marker(spec).parents  # emptied with the cache
    marks: list[str] = []
    # warmed before: the child is stopped, and the target's size is not even asked for
    warmed = SideCompiles.start(["cpu"])
    child = warmed.children[0]
    warmed.assign([spec], lambda device: pytest.fail(f"asked for {device}"), marks.append)
    assert warmed.children == [] and marks == [] and child.proc.returncode is not None
    # not warmed, but the target's size is unknown: stopped too
    cold = dataclasses.replace(spec, shape={**spec.shape, "seq_len": 128})
    unknown = SideCompiles.start(["cpu"])
    child = unknown.children[0]
    unknown.assign([cold], lambda device: None, marks.append)
    assert unknown.children == [] and marks == [] and child.proc.returncode is not None
    unknown.note_warmed()
    assert marker(cold).is_file()


def drafter_specs_of(devices: tuple[str, ...]) -> list[SideSpec]:
    spec = tiny_spec(devices)
    drafter = DrafterConfig(**{**spec.drafter, "target_layer_ids": tuple(spec.drafter["target_layer_ids"])})
    return drafter_specs(
        drafter, ShapeConfig(**spec.shape), CPU_PLAN, ReplicaStep(4.0, 2048), 0, list(devices), torch.float32
    )


def test_the_targets_bytes_per_device_counted_without_loading_it(random_target_dir):
    """What the child's memory cap leaves room for: the model's parameters in bf16 (counted on
    the meta device), a split copy's share on each of its devices, and its warm-up's transient
    activations on each device that holds a share; nothing elsewhere."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_target_dir))
    weights = sum(p.numel() for p in model.parameters()) * 2
    config = AutoConfig.from_pretrained(str(random_target_dir))
    seq_len = 256
    activations = (4 * seq_len * max(config.intermediate_size, config.hidden_size) + 2 * seq_len**2) * 2
    on = target_bytes_by_device(str(random_target_dir), ["cuda:0", ["cuda:1", "cuda:2"]], seq_len)
    assert on("cuda:0") == weights + activations
    assert on("cuda:1") == on("cuda:2") == weights // 2 + activations
    assert on("cuda:3") == 0


def test_children_share_the_cores_unless_the_user_sized_the_pool(monkeypatch):
    """Each child starts its own inductor worker pool; the pool's size is not in the graphs'
    cache keys, so the children split the cores (the size travels in their specs), and an
    exported size is left to the children, which inherit it."""
    from dflash_core.engine.side_compile import compile_threads_share

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    cores = min(32, len(os.sched_getaffinity(0)))  # what inductor starts on its own (capped at 32)
    assert compile_threads_share(1) == cores
    assert compile_threads_share(cores * 2) == 1
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    assert compile_threads_share(4) is None


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_a_pinned_build_sizes_its_childrens_pools_by_its_own_cores():
    """A container pinned to a few cores of a large host: the pool follows the cores the build
    may run on, as inductor's own sizing does, not the host's count."""
    code = (
        "import os; os.environ.pop('TORCHINDUCTOR_COMPILE_THREADS', None); "
        "from dflash_core.engine.side_compile import compile_threads_share; "
        "print(compile_threads_share(1))"
    )
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1", out


def test_a_child_and_what_it_started_are_stopped_together(tmp_path):
    """A child runs in a process group of its own, which its compile workers join; stopping it
    ends them too, and waiting for one that exited ends what it left running."""
    child = SideCompile.start("cpu")
    assert os.getpgid(child.proc.pid) == child.proc.pid
    child.stop()
    # a stand-in child that leaves a worker behind, as inductor's pool does when its owner exits
    spawner = (
        "import subprocess, sys; "
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(w.pid, flush=True)"
    )
    with open(tmp_path / "out", "w+b") as output:
        proc = subprocess.Popen([sys.executable, "-c", spawner], stdout=output, start_new_session=True)
        ended = SideCompile("cpu", proc, output)
        ended.wait(bound=60)
        ended.stop()  # the build's stop after a wait (a later failure) signals no group again
        assert ended.proc.returncode == 0
    worker = int((tmp_path / "out").read_text().split()[0])
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


# a fresh interpreter's engine build up to its children's start, saying whether dynamo was in by then
DYNAMO_AT_START = """
import json, sys
from dflash_core.engine import Engine, EngineConfig
from dflash_core.engine.side_compile import SideCompiles

start = SideCompiles.start

def recording(devices):
    print(json.dumps({"dynamo_imported": "torch._dynamo" in sys.modules}), flush=True)
    SideCompiles.start = start
    raise SystemExit(0)

SideCompiles.start = staticmethod(recording)
Engine(EngineConfig(drafter_devices=["cpu"], target_devices=["cpu"]), sys.argv[1]).build()
"""


def test_the_build_starts_its_children_before_it_imports_dynamo(tmp_path):
    """The children import torch, dynamo and inductor beside the build. Started before the build
    imports dynamo itself (the engine object's compile guard no longer imports it), they reach
    their spec that much sooner."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert run_code(DYNAMO_AT_START, str(tmp_path / "data"), env=env) == {"dynamo_imported": False}


def test_a_failure_in_the_builds_bookkeeping_costs_the_head_start_only():
    """Whatever goes wrong while the build sizes a child's memory (a config it cannot read, say)
    stops that child and lets the build go on, as a failed child does."""
    side = SideCompiles.start(["cpu"])
    child = side.children[0]

    def unreadable(device: str) -> int:
        raise ValueError(f"cannot size the target on {device}")

    side.assign([tiny_spec(shape={"seq_len": 96, "num_anchors": 4, "block_size": 4})], unreadable, lambda _: None)
    assert side.children == [] and child.proc.returncode is not None


def test_no_child_compiles_where_inductors_graph_cache_is_off(tmp_path, monkeypatch):
    """The child's graphs reach the build only through the on-disk graph cache: with it off a
    child would compile for no one, so each is stopped before its spec (and no marker is
    written: nothing to find)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for setting, off in (("force_disable_caches", True), ("fx_graph_cache", False)):
        with monkeypatch.context() as setting_off:
            setting_off.setattr(inductor_config, setting, off)
            side = SideCompiles.start(["cpu"])
            child = side.children[0]
            spec = tiny_spec()
            side.assign([spec], lambda device: pytest.fail(f"asked for {device}"), lambda _: None)
            assert side.children == [] and child.proc.returncode is not None
            side.note_warmed()
            assert not marker(spec).exists()


def test_per_layer_sizes_bound_the_warmup_by_the_largest():
    """Families whose configs list a size per layer (Gemma 3n's MLP widths)."""
    from transformers import Gemma3nTextConfig

    from dflash_core.engine.side_compile import warmup_activation_bytes

    config = Gemma3nTextConfig(intermediate_size=[256, 512, 384], num_hidden_layers=3, hidden_size=128)
    got = warmup_activation_bytes(config, 64, torch.bfloat16)
    assert got >= (4 * 64 * 512 + 2 * 64 * 64) * 2
