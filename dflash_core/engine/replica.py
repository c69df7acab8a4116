"""One drafter replica: its device, fp32 master weights (with bf16 working copies of the weight
matrices on CUDA), frozen head and optimizer."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import DrafterConfig
from ..data.batches import MicroBatch
from ..devices import compute_dtype
from ..drafter import DFlashDrafter, FrozenHead, init_drafter_weights, run_layer
from ..fp8 import quantize_head, use_fp8_linears
from ..step.inputs import StepKernels, StepSettings
from ..step.loss import LOSS_KERNELS
from ..step.micro_step import MicroStepResult, micro_step
from ..step.objectives import ObjectiveInputs
from .config import StepPlan
from .optim import TritonAdamW, build_optimizer, clipped_step, set_lr
from .step_graph import StepGraph

# "fp32": the module's parameters are the fp32 master weights (autocast casts every matrix to
# bf16 in every forward, and every gradient back to fp32). "bf16" (CUDA, Triton AdamW): the
# module's weight matrices are bf16 working copies, the fp32 masters live beside them and the
# optimizer writes both; norms stay fp32.
WORKING_WEIGHTS = ("fp32", "bf16")


@dataclass
class StepAccumulator:
    """Per-step statistics kept on the device (one host sync per step, when read)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor  # [B] counts of right predictions among weighted positions
    counted: torch.Tensor  # [B] weighted positions
    context_tokens: int = 0
    micro_batches: int = 0
    extra: dict = field(default_factory=dict)

    @torch.no_grad()
    def add(self, loss: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor) -> None:
        """One micro-batch's statistics (DrafterReplica.loss_and_backward's)."""
        self.loss_sum += loss
        self.correct += correct
        self.counted += counted
        self.micro_batches += 1

    @staticmethod
    def merged(accs: list[StepAccumulator]) -> StepAccumulator:
        """The replicas' accumulators summed on the host: the step's totals (read once per step;
        a multi-host group sums these totals once more across its ranks)."""
        return StepAccumulator(
            torch.tensor(sum(float(a.loss_sum) for a in accs), dtype=torch.float64),
            torch.stack([a.correct.cpu() for a in accs]).sum(0),
            torch.stack([a.counted.cpu() for a in accs]).sum(0),
            sum(a.context_tokens for a in accs),
            sum(a.micro_batches for a in accs),
        )


@dataclass(frozen=True)
class ReplicaStep:
    """What a replica's micro-step is built with beyond its plan: the loss's position decay and
    chunk size; teacher: the step is the objective step (step.objective_step; features end with
    the target's final hidden states), its objective set per job in the replica's `objective`,
    else the DFlash block CE; kernels: the compiled parts of the step, by default the plan's
    (benchmarks pass their variants)."""

    gamma: float
    chunk_size: int
    teacher: bool = False
    kernels: StepKernels | None = None


class DrafterReplica:
    def __init__(
        self,
        index: int,
        cfg: DrafterConfig,
        device: str | torch.device,
        head: FrozenHead,
        plan: StepPlan,
        step: ReplicaStep,
    ):
        """plan: how the step runs (engine.config.step_plan); step: what its loss is built with.
        The step's settings (StepSettings, the recipe's loss hook among them) are built here, once."""
        device = torch.device(device)
        compute = compute_dtype(device)
        check_plan(plan, device, compute)
        self.index = index
        self.device = torch.device(device)
        self.config = cfg
        with torch.device(self.device):  # allocate and default-init on the device, not the CPU
            self.drafter = DFlashDrafter(cfg)
        self.head = head.to(self.device, compute)
        if plan.precision == "fp8":  # the same parameters, their GEMMs in FP8 (dflash_core.fp8)
            use_fp8_linears(self.drafter.fc)  # the decoder stack and the feature fusion, not the
            use_fp8_linears(self.drafter.layers)  # recipe's heads (their widths follow the vocabulary)
        if plan.loss == "triton_fp8":
            self.head.lm_head_fp8 = quantize_head(self.head.lm_head_weight)
        self.plan = plan
        self.compute_dtype = compute
        settings = StepSettings(
            plan.attention,
            step.gamma,
            step.chunk_size,
            step.kernels if step.kernels is not None else plan_kernels(plan),
            ObjectiveInputs(self.device) if step.teacher else None,
        )
        self.step = settings.with_hooks(cfg) if step.teacher else settings
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.nn.Parameter] = list(self.drafter.parameters())  # fixed for the replica's life
        # masters[i]: the fp32 weight of record for params[i] (what the optimizer updates and
        # checkpoints hold): params[i] itself, or an fp32 tensor beside its bf16 working copy
        self.working_weights = plan.working_weights
        self.masters = make_bf16_working_copies(self.params) if self.working_weights == "bf16" else list(self.params)
        # True when a step's gradient is a sum or mean of several micro-batches' (gradient
        # accumulation, or several replicas averaged by GradSync; the engine sets it per job):
        # the working copies' bf16 gradients then move to fp32 on the masters after every
        # backward, so the sum and the mean are not rounded to bf16 again
        self.sum_grads_in_fp32 = False
        # an event the next optimizer step waits for on the device before it writes the weights
        # and optimizer state in place (set by a checkpoint that is still copying them)
        self.write_guard: torch.cuda.Event | None = None
        # the micro-step as a CUDA graph (step_graph.StepGraph; set by the engine's warm-up), and
        # with it, where a step of several micro-batches sums their gradients: fp32 buffers kept
        # for the job, written afresh by the step's first micro-batch
        self.step_graph: StepGraph | None = None
        self._grad_sums: list[torch.Tensor] | None = None
        # this step's micro-batches so far, and whether they were replayed (a step never mixes)
        self._step_micro_batches = 0
        self._step_replayed = False

    # the step's settings as the engine, the step graph and benchmarks read and set them
    @property
    def attention(self) -> str:
        return self.step.attention

    @property
    def chunk_size(self) -> int:
        return self.step.chunk_size

    @property
    def objective(self) -> ObjectiveInputs | None:
        return self.step.objective

    @property
    def gamma(self) -> float:
        return self.step.gamma

    @gamma.setter
    def gamma(self, value: float) -> None:  # per job (the engine's), read by the step graph's replay
        self.step.gamma = value

    @property
    def kernels(self) -> StepKernels:
        return self.step.kernels

    @kernels.setter
    def kernels(self, value: StepKernels) -> None:  # a benchmark's variant
        self.step.kernels = value

    def working_copies(self) -> list[torch.Tensor | None]:
        """Per master, its bf16 working copy (None where the master is the parameter itself)."""
        return [None if m is p else p for m, p in zip(self.masters, self.params)]

    def named_masters(self):
        return ((name, m) for (name, _), m in zip(self.drafter.named_parameters(), self.masters))

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The fp32 weights of record by parameter name (checkpoints, copies to other replicas)."""
        return {name: m.detach() for name, m in self.named_masters()}

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """DFlashDrafter.init_weights drawn into the masters (the same values in either mode)."""
        init_drafter_weights(self.named_masters(), seed)
        self._refresh_working_copies()

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the named weights in (all, or a backbone's: see warmup.reset_weights)."""
        for name, m in self.named_masters():
            if name in state:
                m.copy_(state[name].to(m.device, m.dtype))
        self._refresh_working_copies()

    @torch.no_grad()
    def _refresh_working_copies(self) -> None:
        for m, p in zip(self.masters, self.params):
            if m is not p:
                p.copy_(m)  # round to nearest even: the same bf16 values autocast would compute with

    def grads(self) -> list[torch.Tensor]:
        """The step's gradient tensors, one per parameter, as the optimizer will read them: a
        master's fp32 sum when micro-batches were summed there, else the parameter's .grad."""
        out = []
        for m, p in zip(self.masters, self.params):
            holder = m if m.grad is not None else p
            if holder.grad is None:
                holder.grad = torch.zeros_like(holder)
            out.append(holder.grad)
        return out

    def zero_grad(self) -> None:
        for m, p in zip(self.masters, self.params):
            p.grad = None
            m.grad = None
        self._step_micro_batches = 0

    @torch.no_grad()
    def _sum_working_grads_in_fp32(self) -> None:
        for m, p in zip(self.masters, self.params):
            if m is p or p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @property
    def _default_cast_cache(self) -> bool:
        """Autocast's cast cache only saves re-casting fp32 weights; bf16 working weights have
        none to cast, and the recorded step must run with it off. The cache setting is part of
        dynamo's guards, so the eager step runs with it off too: both then share one set of
        compiled graphs instead of compiling (and, on a warm start, tracing) everything twice."""
        return self.working_weights != "bf16"

    def autocast(self, cache_enabled: bool = True):
        """cache_enabled=False inside a CUDA graph: cached casts would be freed with the region
        yet replayed."""
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype, cache_enabled=cache_enabled)
        return contextlib.nullcontext()

    def new_accumulator(self) -> StepAccumulator:
        b = self.config.block_size
        z = lambda *s: torch.zeros(*s, dtype=torch.float32, device=self.device)  # noqa: E731
        return StepAccumulator(z(()), z(b), z(b))

    def forward_backward(
        self, batch: MicroBatch, features: torch.Tensor, loss_scale: float, acc: StepAccumulator, graphed: bool = True
    ) -> MicroStepResult | None:
        """Loss and gradients of one micro-batch; gradients accumulate into .grad. Replayed from
        the step's CUDA graph where one was recorded for these shapes (graphed=False: eagerly);
        the per-token result is returned by the eager step only."""
        graph = self.step_graph
        replay = graphed and graph is not None and graph.fits(batch, features)
        if self._step_micro_batches and replay != self._step_replayed:
            # the replay's gradients live in the graph's buffers, the eager step's in .grad
            raise RuntimeError("a step's micro-batches must all have the recorded shapes, or none of them")
        self._step_micro_batches += 1
        self._step_replayed = replay
        if replay:
            self._replay(batch, features, loss_scale, acc)
            return None
        res, stats = self.loss_and_backward(batch, features, loss_scale)
        if self.sum_grads_in_fp32 and self.working_weights == "bf16":
            self._sum_working_grads_in_fp32()
        acc.add(*stats)
        return res

    def loss_and_backward(
        self,
        batch: MicroBatch,
        features: torch.Tensor,
        loss_scale: float | torch.Tensor,
        decay: torch.Tensor | None = None,
        cast_cache: bool | None = None,
    ) -> tuple[MicroStepResult, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """micro_step and its backward, as the eager step and the recorded one (step_graph) run
        them: the result and what the step's accumulator sums of it (loss, right predictions
        [B], weighted positions [B]). decay: micro_step's; cast_cache: autocast's, by default
        off with bf16 working weights (`_default_cast_cache`)."""
        self.drafter.train()
        with self.autocast(self._default_cast_cache if cast_cache is None else cast_cache):
            res = micro_step(self.drafter, self.head, batch, features, self.step, decay)
        (res.loss * loss_scale).backward()
        with torch.no_grad():
            counted = res.weights > 0
            return res, (res.loss.detach(), (res.correct & counted).sum(0).float(), counted.sum(0).float())

    @torch.no_grad()
    def _replay(self, batch: MicroBatch, features: torch.Tensor, loss_scale: float, acc: StepAccumulator) -> None:
        """The recorded micro-step, then the gradients where the eager step leaves them: the
        graph's own buffers for a step of one micro-batch; summed in fp32 on the masters when
        the step has several (sum_grads_in_fp32), as the eager step sums them."""
        graph = self.step_graph
        assert graph is not None
        first = self._step_micro_batches == 1
        if not (first or self.sum_grads_in_fp32):
            # each replay overwrites the graph's gradient buffers: a sum needs the fp32 buffers
            raise RuntimeError("a replayed step of several micro-batches sums them in fp32: set sum_grads_in_fp32")
        graph.replay(batch, features, loss_scale, self.gamma)
        holders = graph.grads
        if self.sum_grads_in_fp32:
            if self._grad_sums is None:
                self._grad_sums = [torch.empty_like(g, dtype=torch.float32) for g in graph.grads]
            if first:
                torch._foreach_copy_(self._grad_sums, graph.grads)
            else:
                torch._foreach_add_(self._grad_sums, graph.grads)
            holders = self._grad_sums
        for m, p, h in zip(self.masters, self.params, holders, strict=True):
            if m is p:
                p.grad = h
            elif self.sum_grads_in_fp32:
                m.grad, p.grad = h, None
            else:
                m.grad, p.grad = None, h
        acc.add(graph.loss, graph.correct, graph.counted)

    def new_optimizer(self, lr: float, weight_decay: float, betas) -> torch.optim.Optimizer:
        """AdamW over the masters (writing the working copies too, in bf16 mode), as self.optimizer."""
        copies = self.working_copies() if self.working_weights == "bf16" else None
        self.optimizer = build_optimizer(self.masters, lr, weight_decay, betas, self.device, working_copies=copies)
        return self.optimizer

    def end_job(self) -> None:
        """Drop what a job kept: gradients, optimizer state, the fp32 gradient sums, the flags."""
        self.zero_grad()
        self.optimizer = None
        self._grad_sums = None
        self.sum_grads_in_fp32 = False
        self.write_guard = None

    def clip_and_step(self, max_norm: float, lr: float) -> torch.Tensor:
        assert self.optimizer is not None, "new_optimizer() first"
        if self.write_guard is not None:  # a checkpoint's copies still read the weights and moments
            torch.cuda.current_stream(self.device).wait_event(self.write_guard)
            self.write_guard = None
        set_lr(self.optimizer, lr)
        norm = clipped_step(self.optimizer, self.grads(), max_norm)
        self.zero_grad()
        return norm


def check_plan(plan: StepPlan, device: torch.device, compute: torch.dtype) -> None:
    """The plan's loss kernel and working weights can run on `device` (computing in `compute`)."""
    if plan.loss not in LOSS_KERNELS:
        raise ValueError(f"loss kernel must be one of {LOSS_KERNELS}, got {plan.loss!r}")
    if plan.loss.startswith("triton") and device.type != "cuda":
        raise ValueError(f"the Triton loss kernel needs a CUDA device, got {device}")
    if plan.precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be bf16 or fp8, got {plan.precision!r}")
    if plan.working_weights not in WORKING_WEIGHTS:
        raise ValueError(f"working_weights must be one of {WORKING_WEIGHTS}, got {plan.working_weights!r}")
    if plan.working_weights == "bf16":
        if device.type != "cuda" or compute != torch.bfloat16:
            raise ValueError(f"bf16 working weights need a CUDA device computing in bf16, got {device}")
        if TritonAdamW is None:
            raise ValueError("bf16 working weights need the Triton AdamW (Triton could not be imported)")


@torch.no_grad()
def make_bf16_working_copies(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Turns the weight matrices among `params` (the GEMM operands) into bf16 in place; the
    norms' vectors stay fp32. Returns the fp32 masters aligned with `params`: a copy of each
    matrix's fp32 values, the parameter itself for the rest."""
    masters: list[torch.Tensor] = []
    for p in params:
        if p.dim() >= 2:
            masters.append(p.detach().clone())
            p.data = p.data.to(torch.bfloat16)
        else:
            masters.append(p)
    return masters


def plan_kernels(plan: StepPlan) -> StepKernels:
    """The step's compiled parts for a plan: one compiled decoder layer (flex_attention inside)
    serves every layer, plus the compiled BlockMask construction and loss chunks. Compiled
    functions, not compiled modules: evaluation calls the eager drafter at other shapes."""
    if not plan.compiled:
        return StepKernels(loss=plan.loss)
    return StepKernels(layer=compiled_run_layer(plan.precision), mask=plan.attention == "flex", loss=plan.loss)


@functools.cache
def compiled_run_layer(precision: str = "bf16"):
    """One process-wide compiled layer function per precision: every layer of every replica
    shares its code (one graph per device, since guards include the device). The FP8 layer is
    compiled without inductor's mix-order reductions: in its backward they fuse a norm's column
    sum (its weight's gradient) with the FP8 casts of the normed rows that the weight gradients'
    GEMMs take column-major, and store those casts one byte at a time, a row's length apart:
    several times slower than the tiled transposes inductor writes without them. The bf16
    layer has no such stores and keeps them (its step is no slower with them)."""
    return torch.compile(run_layer, dynamic=False, options=layer_compile_options(precision))


def layer_compile_options(precision: str) -> dict[str, Any]:
    """Inductor options of the compiled decoder layer (compiled_run_layer). The FP8 layer also
    takes combo kernels: its linears' casts are many small kernels that depend on nothing of each
    other (each weight's amax and cast, each gradient's), which inductor then compiles as fewer,
    wider ones. Fewer kernels to compile and to time at their first run shorten a cold start's
    drafter compile, and the step is no slower. The bf16 layer has few such kernels."""
    import torch._inductor.config as inductor_config

    if precision != "fp8":
        return {}
    options: dict[str, Any] = {}
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        options["triton.mix_order_reduction"] = False
    if hasattr(inductor_config, "combo_kernels"):
        options["combo_kernels"] = True
    return options
