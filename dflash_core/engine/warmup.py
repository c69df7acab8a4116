"""Building the engine's parts and warming them, one device at a time, in the calling thread.

Threads that call a compiled flex_attention forward and backward for the first time together
deadlock inside dynamo and the autograd engine (docs/design.md says how). So nothing here starts
a worker thread: the target copies are loaded and run once each, then every drafter replica runs
one full training step (forward, backward, optimizer) at the production shapes, one after the
other, and only then does the engine start its drafter threads. Compiled graphs are keyed by
device, so each replica compiles (or loads from the cache) its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DrafterConfig, LossConfig, ShapeConfig
from ..data.batches import MicroBatch, synthetic_micro_batch
from ..devices import CudaContexts, compute_dtype, default_devices
from ..libraries import import_target_libraries
from ..parity import check_serving_parity
from ..recipes import recipe_named
from ..target import TargetModel
from ..target_fusion import relative_error
from .api import WarmupRecord
from .compile import compile_delta, compile_snapshot, raise_recompile_limit, start_compile_workers
from .config import EngineConfig, StepPlan, step_plan
from .drafters import GradSync
from .host_snapshot import HostSnapshot
from .pipeline import capture
from .replica import DrafterReplica, ReplicaStep
from .side_compile import SideCompiles, drafter_specs, target_bytes_by_device
from .step_graph import record_step_graph

log = logging.getLogger("dflash.engine")

WARMUP_SEED = 0  # the weights warm-up trains are reset afterwards; every job draws its own


class Timeline:
    """The build's phases and ordered events: what /healthz reports and where time to ready went."""

    def __init__(self, drafters_total: int, on_phase: Callable[[str, int], None]):
        self.t0 = time.monotonic()
        self.drafters_total = drafters_total
        self.phase = "starting"
        self.drafters_ready = 0
        self.events: list[tuple[float, str]] = []
        self.warmup: list[WarmupRecord] = []
        self._on_phase = on_phase
        self._lock = threading.Lock()

    def mark(self, label: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), label))

    def enter(self, phase: str, drafters_ready: int = 0) -> None:
        self.phase, self.drafters_ready = phase, drafters_ready
        self.mark(f"progress:{phase}:{drafters_ready}")
        self._on_phase(phase, drafters_ready)

    def record(self, component: str, device: str | torch.device, started: float) -> None:
        self.warmup.append(WarmupRecord(component, str(device), time.monotonic() - started))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def labels(self) -> list[tuple[str, float]]:
        """(event, seconds since the engine was created), in order."""
        with self._lock:
            return [(label, round(t - self.t0, 3)) for t, label in self.events]


@dataclass
class Parts:
    """What a built engine holds."""

    target_path: str
    tokenizer: object
    drafter_config: DrafterConfig
    pad_token_id: int
    plan: StepPlan
    targets: list[TargetModel]
    replicas: list[DrafterReplica]
    feature_spec: tuple[tuple[int, ...], torch.dtype]  # every micro-batch's target features
    gamma: float  # the recipe's position-weight decay, a job's unless it sets loss_gamma
    # the checkpoint's pinned host buffers, allocated once per engine (every job has the same
    # shapes): pinning gigabytes takes seconds and holds up the device's other calls, which a
    # job would otherwise spend before its first step. None off CUDA.
    snapshot: HostSnapshot | None = None  # the checkpoint's pinned host buffers: the engine's, from ready on

    def description(self, shape: ShapeConfig) -> dict[str, Any]:
        """What every rank of a group must share to train together (compared by rank 0)."""
        from importlib import metadata

        return {
            "drafters": len(self.replicas),
            "versions": [metadata.version("dflash-trainer"), torch.__version__],
            "shape": dict(vars(shape)),
            "drafter": self.drafter_config.to_dict(),
            "plan": str(self.plan),
        }


class PartsView:
    """The built parts as the engine and a run's context read them: `parts` is None until the
    engine is built, when the lists are empty and the rest refuses."""

    parts: Parts | None

    @property
    def built(self) -> Parts:
        assert self.parts is not None, "the engine is not built"
        return self.parts

    @property
    def replicas(self) -> list[DrafterReplica]:
        return self.parts.replicas if self.parts is not None else []

    @property
    def targets(self) -> list[TargetModel]:
        return self.parts.targets if self.parts is not None else []

    @property
    def drafter_config(self) -> DrafterConfig:
        return self.built.drafter_config

    @property
    def tokenizer(self) -> Any:
        return self.built.tokenizer


def resolve_devices(config: EngineConfig) -> tuple[list[str | list[str]], list[str]]:
    """(target_devices, drafter_devices): the configured ones, else this host's default. A target
    entry is one device, or the list of devices one target copy is split over."""
    auto_target, auto_drafter = default_devices()
    targets: list[str | list[str]] = list(config.target_devices or auto_target)
    return targets, list(config.drafter_devices or auto_drafter)


def flat_devices(entries: list[str | list[str]]) -> list[str]:
    return [d for e in entries for d in (e if isinstance(e, list) else [e])]


def device_label(entry: str | list[str]) -> str:
    """How a target copy is named in metrics and logs: its device, or its stages joined by '+'."""
    return "+".join(entry) if isinstance(entry, list) else entry


def build(config: EngineConfig, data_dir: Path, timeline: Timeline, cuda: CudaContexts) -> Parts:
    """Load the target copies and the drafter replicas and warm each device in turn."""
    return _Build(config, timeline).run(data_dir, cuda)


class _Build:
    """One engine build, in the order the devices are warmed: the tokenizer and the drafter's
    architecture, the target copies (loaded, then run once each), the drafter replicas (each
    one full training step, then its step graph recorded where the plan compiles)."""

    def __init__(self, config: EngineConfig, timeline: Timeline):
        self.config, self.timeline = config, timeline
        self.target_devices, self.drafter_devices = resolve_devices(config)
        self.plan = step_plan(self.drafter_devices, config.debug_eager, config.precision)
        if config.target_precision == "fp8":
            from ..fp8 import check_fp8_devices

            check_fp8_devices(flat_devices(self.target_devices), "target_precision")

    def run(self, data_dir: Path, cuda: CudaContexts) -> Parts:
        config, timeline, plan = self.config, self.timeline, self.plan
        # the drafter devices' compile processes, first: they import torch, dynamo and inductor
        # while the build imports them and transformers (side_compile.py)
        side = SideCompiles.start(self.drafter_devices if plan.compiled else [])
        if side.children:
            timeline.mark("build:side_compiles_spawned")
        try:
            if plan.compiled and any(d.startswith("cuda") for d in self.drafter_devices) and start_compile_workers():
                timeline.mark("build:compile_workers_started")  # ready by the first drafter compile
            timeline.enter("loading_target")
            target_path, layer_ids = _target_source(config, data_dir)
            import_target_libraries()  # the build's first import of transformers (libraries.py)
            tokenizer, drafter_config = self.drafter_config(target_path, layer_ids)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
            cuda.wait()
            timeline.mark("build:cuda_contexts")
            gamma = recipe_gamma(config.recipe, config.block_size)
            # what every replica's micro-step is built with, the compile processes' too
            step = ReplicaStep(gamma, LossConfig().chunk_size, teacher=config.teacher)
            self.assign_side_compiles(side, target_path, drafter_config, pad, step)
            targets = self.load_targets(target_path, drafter_config.target_layer_ids)
            drafter_config = serving_inputs(drafter_config, targets[0])
            timeline.enter("warming_target")
            batch = synthetic_micro_batch(config.shape, drafter_config.vocab_size, pad)
            features = self.warm_targets(targets, batch)
            side.wait(features, timeline.mark)
            replicas = self.make_replicas(drafter_config, targets[0].frozen_head(), step)
            # another micro-batch than the recorded one, to check a recorded step graph on
            check = synthetic_micro_batch(config.shape, drafter_config.vocab_size, pad, seed=WARMUP_SEED + 1)
            self.warm_drafters(replicas, batch, features, check)
        except BaseException:
            side.stop()
            raise
        side.note_warmed()
        GradSync().average([rep.grads() for rep in replicas])  # exercise this host's sync path once
        for rep in replicas:
            rep.zero_grad()
        reset_weights(replicas, WARMUP_SEED)
        feature_spec = (tuple(features.shape), features.dtype)
        return Parts(str(target_path), tokenizer, drafter_config, pad, plan, targets, replicas, feature_spec, gamma)

    def assign_side_compiles(
        self, side: SideCompiles, target_path: str, drafter_config: DrafterConfig, pad: int, step: ReplicaStep
    ) -> None:
        """Give the compile processes their specs, now that the drafter is known (side_compile.py
        says which compile and which stop); a plan that does not compile started none."""
        if not self.plan.compiled:
            return
        dtype = compute_dtype(flat_devices(self.target_devices)[0])
        specs = drafter_specs(drafter_config, self.config.shape, self.plan, step, pad, self.drafter_devices, dtype)
        side.assign(
            specs, target_bytes_by_device(target_path, self.target_devices, self.config.seq_len), self.timeline.mark
        )

    def drafter_config(self, target_path: str, layer_ids: list[int] | None) -> tuple[Any, DrafterConfig]:
        """The target's tokenizer (with the mask token it may add) and the drafter's architecture."""
        config, timeline = self.config, self.timeline
        from transformers import AutoConfig, AutoTokenizer

        timeline.mark("build:transformers_imported")
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        hf_cfg = AutoConfig.from_pretrained(target_path)
        timeline.mark("build:tokenizer_and_config")
        mask_id = mask_token_id(tokenizer, hf_cfg.vocab_size, config.mask_token)
        drafter_config = DrafterConfig.from_target_config(
            hf_cfg,
            num_hidden_layers=config.drafter_layers,
            block_size=config.block_size,
            mask_token_id=mask_id,
            target_layer_ids=layer_ids,
            intermediate_size=config.drafter_intermediate_size,
            sliding_window=config.drafter_sliding_window,
            recipe=config.recipe,
            markov_rank=engine_markov_rank(config, hf_cfg),
            markov_head_type=config.markov_head_type,
            layout=config.layout,
        )
        drafter_config = dataclasses.replace(
            drafter_config, mask_token=str(tokenizer.convert_ids_to_tokens(mask_id)), num_anchors=config.num_anchors
        )
        check_rope_positions(drafter_config, config.seq_len, config.block_size)
        if self.plan.precision == "fp8":
            from ..fp8 import check_fp8_shapes

            check_fp8_shapes(drafter_config, config.seq_len, config.num_anchors, config.block_size)
        return tokenizer, drafter_config

    def load_targets(self, target_path: str, layer_ids: list[int] | tuple[int, ...]) -> list[TargetModel]:
        targets = []
        for dev in self.target_devices:
            t = time.monotonic()
            targets.append(
                TargetModel(
                    target_path,
                    layer_ids,
                    dev,
                    random_init=self.config.target_random_init,
                    seed=WARMUP_SEED,
                    teacher=self.config.teacher,
                    fp8=self.config.target_precision == "fp8",
                )
            )
            self.timeline.record("target_load", device_label(dev), t)
            self.timeline.mark(f"build:target_loaded:{device_label(dev)}")
        return targets

    def warm_targets(self, targets: list[TargetModel], batch: MicroBatch) -> torch.Tensor:
        """Each target copy captures the warm-up micro-batch (and records its graph where the plan
        compiles); the first copy's features, which the drafters warm on."""
        features = None
        for target in targets:
            t = time.monotonic()
            feats = capture(target, batch)
            for stage in target.stages:
                _sync(stage)
            if features is None:  # reused by the drafters
                features = feats
            if self.plan.compiled:
                self.record_target_graph(target, batch, feats)
            self.timeline.record("target", target.label, t)
            self.timeline.mark(f"build:target_warm:{target.label}")
        assert features is not None
        return features

    def record_target_graph(self, target: TargetModel, batch: MicroBatch, eager: torch.Tensor) -> None:
        """The target's capture as a CUDA graph (TargetModel.record_graph) of its fused layers,
        kept only if its replay of the warm-up micro-batch gives what the recorded code gives run
        without the graph, bit for bit, and a fused layer's output is the eager layer's up to rounding;
        else the graph of the eager layers, under the first rule; else eager captures."""
        for fuse in (True, False):
            try:
                if not target.record_graph(self.config.seq_len, fuse=fuse):
                    return
                problem = self.graph_problem(target, batch, eager)
            except Exception as e:  # noqa: BLE001 - a family the compiler cannot take runs its eager layers
                if not fuse:
                    raise
                problem = f"its layers did not compile: {type(e).__name__}: {str(e)[:500]}"
            if problem is None:
                self.timeline.mark(f"build:target_graph{':fused' if fuse else ''}:{target.label}")
                return
            target.drop_graph()
            log.warning(
                "the target's CUDA graph is not kept: %s",
                problem,
                extra={"fields": {"device": target.label, "fused": fuse}},
            )

    def graph_problem(self, target: TargetModel, batch: MicroBatch, eager: torch.Tensor) -> str | None:
        dev = target.device
        replayed = capture(target, batch).clone()
        ungraphed = target.capture_ungraphed(batch.input_ids.to(dev), batch.position_ids.to(dev), batch.doc_ids.to(dev))
        _sync(dev)
        if not torch.equal(replayed, ungraphed):
            return "its replay differs from the forward it recorded"
        if not target.fused:
            return None
        error = target.fused_layer_error(*(t.to(dev) for t in (batch.input_ids, batch.position_ids, batch.doc_ids)))
        log.info(
            "fused target layers: relative error %.2e of a layer's output, %.2e of the features",
            error,
            relative_error(ungraphed, eager),
            extra={"fields": {"device": target.label, "relative_error": error}},
        )
        if error > target.fused_tolerance:
            return f"a fused layer's output is {error:.2e} off the eager layer's (tolerance {target.fused_tolerance})"
        return None

    def make_replicas(self, drafter_config: DrafterConfig, head: Any, step: ReplicaStep) -> list[DrafterReplica]:
        if self.plan.compiled:
            raise_recompile_limit(len(self.drafter_devices))
        replicas = []
        for i, dev in enumerate(self.drafter_devices):
            replicas.append(DrafterReplica(i, drafter_config, dev, head, self.plan, step))
            self.timeline.mark(f"build:replica_created:{dev}")
        reset_weights(replicas, WARMUP_SEED)
        self.timeline.mark("build:weights_initialized")
        return replicas

    def warm_drafters(
        self, replicas: list[DrafterReplica], batch: MicroBatch, features: torch.Tensor, check: MicroBatch
    ) -> None:
        """One replica after the other: a full training step, then (compiled plans) the step
        graph, recorded on `batch` and checked on `check`."""
        timeline, compiled = self.timeline, self.plan.compiled
        timeline.enter("warming_drafters")
        timeline.mark("warmup:drafters:start")
        for i, rep in enumerate(replicas):
            t = time.monotonic()
            before = compile_snapshot() if compiled else {}
            warm_replica(rep, batch, features)
            # the compiled step's first run (compiles or cache loads, first launches) apart from
            # recording and checking its graph: a warm start's two costs of a drafter GPU
            timeline.mark(f"build:drafter_step:{rep.device}")
            if compiled and record_step_graph(rep, batch, features, check):
                timeline.mark(f"build:step_graph:{rep.device}")
            timeline.record("drafter", rep.device, t)
            if compiled:  # where this GPU's compile seconds went (cold: built kernels; warm: cache loads)
                delta = compile_delta(before, compile_snapshot())
                fields = {"device": str(rep.device), "seconds": round(time.monotonic() - t, 3), **delta}
                log.info("drafter warm-up compiles", extra={"fields": fields})
            timeline.mark(f"warmup:drafter:{rep.device}")
            timeline.enter("warming_drafters", i + 1)


def engine_markov_rank(config: EngineConfig, target_config) -> int:
    """The DSpark Markov rank: the configured one (below the vocabulary size), else the public
    default capped for the target; 0 for a recipe without heads."""
    if not recipe_named(config.recipe).heads:
        return 0
    from ..recipes.dspark_settings import default_markov_rank

    vocab, hidden = int(target_config.vocab_size), int(target_config.hidden_size)
    if config.markov_rank is None:
        return default_markov_rank(vocab, hidden)
    if config.markov_rank >= vocab:
        raise ValueError(f"markov_rank: {config.markov_rank} must be below the target's vocabulary size {vocab}")
    return config.markov_rank


def recipe_gamma(recipe: str, block_size: int) -> float:
    """The position-weight decay of a recipe's default loss."""
    return LossConfig(gamma=recipe_named(recipe).gamma).resolved_gamma(block_size)


def _target_source(config: EngineConfig, data_dir: Path) -> tuple[str, list[int] | None]:
    """The target's directory and the layer ids to capture (None: the DFlash rule)."""
    if config.target_path is not None:
        return str(config.target_path), config.target_layer_ids
    from ..defaults import DEFAULT_TARGET_LAYER_IDS, ensure_default_assets

    # the tiny target's own ids: the rule would pick the same layer twice for its depth
    ids = config.target_layer_ids or list(DEFAULT_TARGET_LAYER_IDS)
    return str(ensure_default_assets(data_dir).target), ids


def serving_inputs(drafter_config: DrafterConfig, target: TargetModel) -> DrafterConfig:
    """The drafter config with the target's embedding scale, after refusing (TargetRefused) a
    target whose drafter inputs the serving loops compute otherwise (parity.py)."""
    check_serving_parity(target.config, len(target.decoder_layers()), drafter_config.target_layer_ids)
    scale = target.embedding_scale
    if scale != 1.0:
        log.warning(
            "the target's embedding scales its table: the drafter trains on the scaled rows, and its checkpoint "
            "says so (dflash_config.input_embedding_scale); vLLM's Qwen3 DFlash model feeds unscaled rows: "
            "serve it with SGLang or the reference",
            extra={"fields": {"input_embedding_scale": scale}},
        )
    return dataclasses.replace(drafter_config, input_embedding_scale=scale)


def check_rope_positions(cfg: DrafterConfig, seq_len: int, block_size: int) -> None:
    """Refuse shapes whose positions pass the range in which the drafter's fixed RoPE is the
    reference's ("dynamic", "longrope": DrafterConfig.rope_position_limit). A micro-batch holds
    positions below seq_len (context) and block positions up to seq_len + block_size - 2."""
    limit = cfg.rope_position_limit
    if limit is not None and seq_len + block_size - 1 > limit:
        raise ValueError(
            f"the target's {cfg.rope_type!r} RoPE takes other frequencies from position {limit} on: seq_len "
            f"{seq_len} with block_size {block_size} reaches position {seq_len + block_size - 2}; use seq_len "
            f"<= {limit - block_size + 1}"
        )


def mask_token_id(tokenizer, vocab_size: int, name: str | None) -> int:
    """The block's mask token: the configured one, else the tokenizer's, else <|mask|> added
    (it must fall inside the target's vocabulary: the frozen embedding has a row for it)."""
    if name is None and tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    name = name or "<|mask|>"
    ids = tokenizer.convert_tokens_to_ids([name])
    if ids and ids[0] is not None and ids[0] != tokenizer.unk_token_id:
        return int(ids[0])
    tokenizer.add_special_tokens({"mask_token": name})
    mid = int(tokenizer.mask_token_id)
    if mid >= vocab_size:
        raise ValueError(f"mask token {name!r} got id {mid}, outside the target vocabulary ({vocab_size})")
    return mid


def warm_replica(rep: DrafterReplica, mb: MicroBatch, features: torch.Tensor) -> None:
    """One full training step at the production shape, in this thread. With bf16 working weights
    a second step sums its gradient in fp32 on the masters (what gradient accumulation and
    several replicas do): the AdamW kernel's variant for fp32 gradients beside a working copy is
    built here too, not in a drafter thread mid-job."""
    feats = features.to(rep.device)
    batch = mb.to(rep.device)
    rep.new_optimizer(1e-4, 0.0, (0.9, 0.95))
    for fp32_sum in (False, True) if rep.working_weights == "bf16" else (False,):
        rep.sum_grads_in_fp32 = fp32_sum
        acc = rep.new_accumulator()
        rep.forward_backward(batch, feats, 1.0, acc)
        rep.clip_and_step(1.0, 1e-4)
        float(acc.loss_sum)  # completes the step on the device
    rep.sum_grads_in_fp32 = False
    rep.optimizer = None
    _sync(rep.device)


def reset_weights(replicas: list[DrafterReplica], seed: int, init_from: dict[str, torch.Tensor] | None = None) -> None:
    """Every replica gets the same starting weights: the given state, or one draw on the first
    replica's device copied to the others. A state without the recipe's heads (a DFlash
    backbone warm-starting a DSpark drafter) gives the backbone; the heads start from the draw,
    as a drafter trained from scratch starts them."""
    first = replicas[0]
    names = {name for name, _ in first.named_masters()}
    if init_from is None or names - set(init_from):
        first.init_weights(seed)
    if init_from is not None:
        first.load_state({name: t for name, t in init_from.items() if name in names})
    state = first.weights_state()
    for rep in replicas:
        if rep is not first:
            rep.load_state(state)
        rep.zero_grad()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
