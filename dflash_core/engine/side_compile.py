"""A cold start's drafter compile in a child process, beside the target's.

A cold start compiles the target's fused layer and then each drafter GPU's step (dynamo,
AOTAutograd, inductor's lowering), one after the other in the build thread. Both are mostly
Python that holds the GIL, so a thread cannot overlap them; a process can. The build starts one
child per distinct drafter device as its first step, before it imports dynamo itself: the child
imports torch, dynamo and inductor while the build imports them and transformers, and is ready
the sooner for its spec. Once the drafter's architecture is known, each child gets its spec
(with its share of the cores for inductor's worker pool), builds a replica on its device with
stand-ins for what the target would hand it (a random head and random features of the target's
shapes and dtype: only shapes, dtypes and devices reach the compiled graphs' keys), runs the
warm-up's training step and step graph, and exits. Its graphs land in the shared compile cache, from
which the build's own drafter warm-up then loads them, as a warm start does. The build waits
for the children before it creates its replicas, so a child's memory is free by then.

A child compiles only where it pays and cannot hurt, and is stopped elsewhere:
- the cache has not seen this drafter warmed on this device (a marker in the compile cache
  directory, written after the build's drafter warm-up and keyed by what the compiled graphs
  depend on): a warm start stops its children before they compile anything;
- the device has room beside what the target will take there: the child's allocator is capped
  at what that leaves free, so the child runs out of memory before the build would;
- inductor's on-disk graph cache is on: without it the child's graphs would reach no one.
A child that fails, or outlasts WAIT_BOUND_S, costs its time only: the build compiles as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .replica import ReplicaStep

log = logging.getLogger("dflash.engine")

# A cold drafter compile takes a minute or two on a loaded host; a child still running after this
# is stuck, and the build compiles for itself rather than hold its ready back longer.
WAIT_BOUND_S = 600.0
# What the build keeps free on a device beside the target's weights and the child's cap: the
# target's warm-up activations, its recorded graph and the CUDA contexts.
HEADROOM_FRACTION = 0.06
# Below this share of the device, the child's step would not fit anyway: no child.
MIN_CHILD_FRACTION = 0.2
MARKER_DIR = "dflash-drafters-warmed"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # dflash_core
RESULT_PREFIX = "side-compile-result "


@dataclass(frozen=True)
class SideSpec:
    """What a child needs to compile one drafter device's step as the build will."""

    device: str
    drafter: dict[str, Any]  # DrafterConfig.to_dict()
    shape: dict[str, int]  # ShapeConfig's fields
    plan: dict[str, Any]  # StepPlan's fields
    gamma: float
    chunk_size: int
    teacher: bool
    pad_token_id: int
    replica_index: int
    drafter_devices: int  # the recompile limit grows with them
    features: tuple[int, int]  # [S, width] of the target's capture
    dtype: str  # the target's compute dtype, which its head and features have
    memory_fraction: float | None = None  # the child's allocator cap on its device
    compile_threads: int | None = None  # the child's inductor worker pool (compile_threads_share)

    def key(self) -> str:
        """What the drafter's compiled graphs on this device depend on, hashed: the marker's name
        (the code that builds them too: another version of this package or of torch or Triton is
        another key, as it is another compile)."""
        props = torch.cuda.get_device_properties(self.device) if self.device.startswith("cuda") else None
        fields = dataclasses.asdict(self)
        # none of these reaches the graphs (the devices' count sets dynamo's recompile limit)
        for name in ("memory_fraction", "compile_threads", "replica_index", "drafter_devices"):
            fields.pop(name)
        fields["drafter"] = {k: v for k, v in self.drafter.items() if k not in ("mask_token", "input_embedding_scale")}
        fields["code"] = code_version()
        fields["gpu"] = [props.name, props.major, props.minor] if props is not None else None
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def code_version() -> list[str]:
    """torch's and Triton's versions and a hash of this package's sources."""
    import triton

    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return [torch.__version__, triton.__version__, digest.hexdigest()[:16]]


def drafter_specs(
    drafter: Any,
    shape: Any,
    plan: Any,
    step: ReplicaStep,
    pad_token_id: int,
    devices: list[str],
    target_dtype: torch.dtype,
) -> list[SideSpec]:
    """One spec per distinct drafter device (replicas that share a device share its graphs), as
    the build will warm it: drafter a DrafterConfig, shape a ShapeConfig, plan a StepPlan, step
    the replicas' ReplicaStep; target_dtype: the target's, which its head and features have."""
    width = feature_width(drafter.hidden_size, drafter.target_layer_ids, step.teacher)
    canonical = [canonical_device(d) for d in devices]
    # a device's first replica, and the count of all replicas, as the build's warm-up sees them
    first = {dev: canonical.index(dev) for dev in distinct_devices(devices)}
    return [
        SideSpec(
            device=dev,
            drafter=drafter.to_dict(),
            shape=dataclasses.asdict(shape),
            plan=dataclasses.asdict(plan),
            gamma=step.gamma,
            chunk_size=step.chunk_size,
            teacher=step.teacher,
            pad_token_id=pad_token_id,
            replica_index=i,
            drafter_devices=len(devices),  # the build's recompile limit counts every replica
            features=(shape.seq_len, width),
            dtype=str(target_dtype).removeprefix("torch."),
        )
        for dev, i in first.items()
    ]


def distinct_devices(devices: list[str]) -> list[str]:
    """Each device once, in order, as `cuda:<index>` ("cuda" and "cuda:0" are one GPU)."""
    return list(dict.fromkeys(canonical_device(d) for d in devices))


def canonical_device(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def feature_width(hidden_size: int, layer_ids: tuple[int, ...] | list[int], teacher: bool) -> int:
    """The capture's width: the captured layers' hidden states, and a teacher's final one."""
    return hidden_size * (len(layer_ids) + (1 if teacher else 0))


def marker(spec: SideSpec) -> Path:
    """Where the build notes that it warmed this drafter on this device: inside the compile cache,
    so that emptying the cache empties the notes with it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir()) / MARKER_DIR / spec.key()


def note_warmed(spec: SideSpec) -> None:
    """After the build's warm-up of spec's device: a later cold-looking build need not compile
    beside the target (a failure to write costs the next start its head start, nothing else)."""
    path = marker(spec)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": spec.device, "written": time.time()}))
    except OSError as e:
        log.warning("could not note the drafter warm-up in the compile cache: %s", e)


class SideCompile:
    """A child process for one drafter device: started early (start), it imports torch, dynamo
    and inductor while the build imports transformers; then either given its spec to compile
    (send) or stopped; once given one, waited for (wait)."""

    def __init__(self, device: str, proc: subprocess.Popen, output: IO[bytes]):
        self.device, self.proc, self._output = device, proc, output
        self.started = time.monotonic()
        self._ended = False  # the child reaped and its group ended: its ids may belong to others now

    @staticmethod
    def start(device: str) -> SideCompile:
        """The child, importing; nothing here imports dynamo or inductor (child_env), so the build
        starts it before its own imports of them."""
        # unnamed, nothing left on disk; closed when the child is waited for or stopped
        output = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                # -P: the working directory does not shadow the build's packages
                [sys.executable, "-P", "-m", "dflash_core.engine.side_compile_child", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=child_env(),
                # its own process group, which its compile workers join: stopped together
                start_new_session=True,
            )
        except BaseException:
            output.close()
            raise
        return SideCompile(device, proc, output)

    def send(self, spec: SideSpec) -> None:
        """The spec to compile; the child starts at once (its imports may still be running)."""
        assert self.proc.stdin is not None
        self.started = time.monotonic()
        try:  # a few kilobytes: the pipe takes them whether or not the child reads yet
            self.proc.stdin.write(json.dumps(dataclasses.asdict(spec)).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # the child is gone already: its output says why
            pass

    def wait(self, bound: float = WAIT_BOUND_S) -> dict[str, Any]:
        """The child's result ({"ok": bool, ...}); a child still running `bound` seconds after its
        spec was sent is killed."""
        try:
            self.proc.wait(timeout=max(0.0, bound - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            return self._finish({"ok": False, "error": f"still compiling after {bound:.0f} s: stopped"})
        self._end()  # its compile workers, which outlive a child that exits at once
        return self._finish(self._result())

    def stop(self) -> None:
        self._end()
        self._output.close()

    def _end(self) -> None:
        """The child and whatever it started (inductor's worker pool), at once: a worker in the
        middle of a Triton build would otherwise finish it for no one. Once only: after that the
        group's id may be another process's."""
        if not self._ended:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.poll() is None:  # not its group's leader after all
                self.proc.kill()
            self.proc.wait()
            self._ended = True
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def _result(self) -> dict[str, Any]:
        text = self._read()
        for line in reversed(text.splitlines()):
            if line.startswith(RESULT_PREFIX):
                try:
                    result = json.loads(line[len(RESULT_PREFIX) :])
                except ValueError:
                    break
                if isinstance(result, dict) and "ok" in result:
                    return result
                break
        return {"ok": False, "error": f"exited {self.proc.returncode}: {text[-1500:].strip()}"}

    def _read(self) -> str:
        self._output.seek(0)
        return self._output.read().decode(errors="replace")

    def _finish(self, result: dict[str, Any]) -> dict[str, Any]:
        self._output.close()
        return {**result, "device": self.device, "seconds": round(time.monotonic() - self.started, 2)}


def child_env() -> dict[str, str]:
    """The build's environment (its compile cache variables among them, which use_cache_dir set),
    with this package importable where it is not installed."""
    import site

    env = dict(os.environ)
    root = str(PACKAGE_ROOT.parent)
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if os.path.realpath(root) not in installed:  # a checkout: the child starts without its cwd on the path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def compile_threads_share(siblings: int) -> int | None:
    """The size of a child's inductor worker pool: this process's own (the cores it may run on,
    capped: inductor's rule) split among the `siblings` children, since each starts its own pool
    and the size is not in the graphs' cache keys. None where the user exported
    TORCHINDUCTOR_COMPILE_THREADS, which the children inherit and keep."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return None
    import torch._inductor.config as inductor_config

    return max(1, (inductor_config.compile_threads or 1) // max(1, siblings))


def graph_cache_on() -> bool:
    """Whether a child's graphs can reach the build: through inductor's on-disk graph cache,
    which the user may have turned off (TORCHINDUCTOR_FX_GRAPH_CACHE=0 or
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1); without it a child compiles for no one."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.fx_graph_cache) and not bool(getattr(inductor_config, "force_disable_caches", False))


def memory_fraction(device: str, target_bytes: int) -> float | None:
    """The child's allocator cap on `device` as a share of it: what is free now less the target's
    weights that will load there and the headroom; None where that leaves too little."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    room = free - target_bytes - HEADROOM_FRACTION * total
    return None if room < MIN_CHILD_FRACTION * total else room / total


def target_bytes_by_device(
    target_path: str, entries: list[str | list[str]], seq_len: int
) -> Callable[[str], int | None]:
    """device -> the bytes the target will take there while a child runs: its weights (a copy's
    share per stage) and its warm-up's transient activations, for the target copies `entries` (a
    device, or the devices one copy is split over); counted once, for the first device asked."""
    stages = [distinct_devices(e if isinstance(e, list) else [e]) for e in entries]

    @functools.cache
    def sizes() -> tuple[int, int] | None:
        from transformers import AutoConfig

        from ..devices import compute_dtype

        config = AutoConfig.from_pretrained(target_path)
        dtype = compute_dtype("cuda")
        weights = target_weight_bytes(config, dtype)
        return None if weights is None else (weights, warmup_activation_bytes(config, seq_len, dtype))

    def on(device: str) -> int | None:
        device = canonical_device(device)
        share = sum(1 / len(copy) for copy in stages if device in copy)
        if not share:
            return 0
        counted = sizes()
        return None if counted is None else int(counted[0] * share + counted[1])

    return on


def warmup_activation_bytes(hf_config: Any, seq_len: int, dtype: torch.dtype) -> int:
    """A bound on what the target's warm-up holds at once beyond its weights: a layer's MLP
    intermediates (gate, up and their product) and residual stream at seq_len tokens, the
    additive [S, S] masks, and where the family's attention is eager its [heads, S, S] scores,
    their softmax and its cast, each in the target's dtype."""
    from ..target import attention_implementation

    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = _largest(getattr(text, "hidden_size", 0))
    inner = _largest(getattr(text, "intermediate_size", 0)) or 4 * hidden
    heads = _largest(getattr(text, "num_attention_heads", 0))
    scores = 3 * heads * seq_len * seq_len if attention_implementation(hf_config) == "eager" else 0
    return (4 * seq_len * max(inner, hidden) + 2 * seq_len * seq_len + scores) * dtype.itemsize


def _largest(size: Any) -> int:
    """A config's size, or the largest of its per-layer sizes (a list in some families)."""
    if isinstance(size, list | tuple):
        return max((int(s) for s in size if s), default=0)
    return int(size or 0)


def target_weight_bytes(hf_config: Any, dtype: torch.dtype) -> int | None:
    """The target's weights in the dtype it loads in, counted on the meta device (no memory, no
    files read); None where the family cannot be built from its config."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:  # noqa: BLE001 - an unknown family loses the head start, not the build
        log.info("no drafter compile beside the target: its size is unknown (%s)", e)
        return None
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


class SideCompiles:
    """The build's children: one per distinct drafter device, started before the build knows the
    drafter's architecture (start), then kept for the devices whose step is not in the cache yet
    and that have room for it, and stopped for the others (assign)."""

    def __init__(self, children: list[SideCompile]):
        self.children = children
        self.specs: list[SideSpec] = []  # every drafter device's, for the notes after warm-up

    @staticmethod
    def start(devices: list[str]) -> SideCompiles:
        children: list[SideCompile] = []
        try:
            for device in distinct_devices(devices):  # replicas that share a device share its graphs
                children.append(SideCompile.start(device))
        except OSError as e:  # no process to be had: the build compiles for itself
            log.warning("could not start the drafter compile beside the target: %s", e)
        except BaseException:
            SideCompiles(children).stop()
            raise
        return SideCompiles(children)

    def assign(
        self, specs: list[SideSpec], target_bytes: Callable[[str], int | None], mark: Callable[[str], None]
    ) -> None:
        """Give each child its device's spec, or stop it where the cache has seen this drafter
        warmed there or the device lacks room. target_bytes(device): what the target will take
        there (None: unknown, no child); asked only where a child would compile. mark(label):
        the build timeline's. With inductor's graph cache off, every child is stopped: its graphs
        would reach the build only through that cache."""
        self.specs = specs
        if self.children and not graph_cache_on():
            log.info("no drafter compile beside the target: inductor's graph cache is off")
            self.stop()
            self.children = []
            return
        by_device = {spec.device: spec for spec in specs}  # both canonical (distinct_devices)
        threads = compile_threads_share(len(self.children))
        kept = []
        for child in self.children:
            spec = by_device[child.device]
            try:
                fraction = self._fraction(spec, target_bytes)
            except Exception as e:  # noqa: BLE001 - the head start is lost, the build compiles as before
                log.warning("no drafter compile beside the target on %s: %s: %s", spec.device, type(e).__name__, e)
                fraction = None
            if fraction is None:
                child.stop()
                continue
            child.send(dataclasses.replace(spec, memory_fraction=round(fraction, 4), compile_threads=threads))
            mark(f"build:side_compile_started:{spec.device}")
            kept.append(child)
        self.children = kept

    @staticmethod
    def _fraction(spec: SideSpec, target_bytes: Callable[[str], int | None]) -> float | None:
        """The child's memory cap on spec's device; None where it should not compile: the cache
        has seen this drafter warmed there, the target's size is unknown, or too little is left."""
        if marker(spec).exists():
            return None
        weights = target_bytes(spec.device)
        fraction = None if weights is None else memory_fraction(spec.device, weights)
        if fraction is None:
            log.info("no drafter compile beside the target: too little memory on %s", spec.device)
        return fraction

    def wait(self, features: torch.Tensor, mark: Callable[[str], None]) -> None:
        """Every child's end, logged; the stand-in features checked against the target's."""
        for child in self.children:
            result = child.wait()
            mark(f"build:side_compile_done:{child.device}")
            if result["ok"]:
                log.info("drafter compiled beside the target", extra={"fields": result})
            else:
                log.warning("the drafter compile beside the target failed; compiling here", extra={"fields": result})
        if not self.children:
            return
        got = (tuple(features.shape), str(features.dtype).removeprefix("torch."))
        assumed = (self.specs[0].features, self.specs[0].dtype)  # every device's are the same
        if got != assumed:
            log.warning(
                "the drafter compile beside the target assumed other features than the target gives",
                extra={"fields": {"assumed": [list(assumed[0]), assumed[1]], "target": [list(got[0]), got[1]]}},
            )

    def note_warmed(self) -> None:
        if not graph_cache_on():  # nothing of this warm-up is in the cache for a later start
            return
        for spec in self.specs:
            note_warmed(spec)

    def stop(self) -> None:
        for child in self.children:
            child.stop()
