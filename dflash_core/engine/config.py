"""Typed configuration of the engine (devices, shapes, precision, compile) and of one job."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import LossConfig, ShapeConfig


@dataclass
class EngineConfig:
    """What the engine is built with; fixed for the life of the process.

    target_path: HF model dir (with tokenizer); None = the embedded tiny default.
    drafter_devices: one drafter replica per entry ("cuda:1", "cpu"); may equal the target's.
    attention: "flex" (compiled flex_attention, CUDA), "dense" (SDPA + boolean mask) or "auto".
    compile: compile the attention kernels (default: on for CUDA, off for CPU).
    compile_scope: "layer" (one compiled decoder layer with flex inside serves every layer, plus
        the compiled BlockMask and loss chunks), "attention" (flex_attention alone, layers eager)
        or "step" (the whole drafter forward; several times the cold compile of "layer").
    """

    target_path: str | None = None
    target_random_init: bool = False  # architecture of target_path, random weights (benchmarks)
    target_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = field(default_factory=lambda: ["cpu"])
    shape: ShapeConfig = field(default_factory=lambda: ShapeConfig(seq_len=512, num_anchors=64, block_size=8))
    drafter_layers: int = 2
    target_layer_ids: list[int] | None = None
    drafter_intermediate_size: int | None = None
    mask_token: str | None = None  # default: the tokenizer's mask token, else "<|mask|>" added
    attention: str = "auto"
    compile: bool | None = None
    compile_scope: str = "layer"
    flex_q_splits: int = 1  # queries as this many flex batch entries (FlexAttention.q_splits); 1 = off
    # lm_head + CE chunks: "compiled" (inductor), "triton" (CUDA only: a two-pass CE kernel, no
    # compiled loss graph; ce_triton.py) or "auto" (triton where every drafter is on CUDA)
    loss_kernel: str = "auto"
    # the weights the drafter computes with: "fp32" (the masters; autocast casts them every step),
    # "bf16" (CUDA only: bf16 working copies of the weight matrices, fp32 masters in the
    # optimizer; replica.py) or "auto" (bf16 where every drafter is on CUDA)
    working_weights: str = "auto"
    loss: LossConfig = field(default_factory=LossConfig)
    init_seed: int = 0
    inductor_cache_dir: str | None = None
    # inductor's Triton worker pool: "early" (started when the build starts, ready by the first
    # drafter compile; compile_workers.py) or "lazy" (torch's own: at the first compile)
    compile_workers: str = "early"
    warmup_delay_seconds: float = 0.0  # pause per warmup phase (tests observe the warming state)
    queue_depth: int = 4  # bounded hand-off queue per drafter (micro-batches)

    def resolved_attention(self) -> str:
        if self.attention != "auto":
            return self.attention
        return "flex" if self._cuda_drafters() else "dense"

    def resolved_loss_kernel(self) -> str:
        if self.loss_kernel != "auto":
            return self.loss_kernel
        return "triton" if self._cuda_drafters_with_triton() else "compiled"

    def resolved_working_weights(self) -> str:
        if self.working_weights != "auto":
            return self.working_weights
        return "bf16" if self._cuda_drafters_with_triton() else "fp32"

    def _cuda_drafters(self) -> bool:
        return all(d.startswith("cuda") for d in self.drafter_devices)

    def _cuda_drafters_with_triton(self) -> bool:
        if not self._cuda_drafters():
            return False
        from .optim import TritonAdamW  # None when Triton is missing or its kernels do not import

        return TritonAdamW is not None

    def resolved_compile(self) -> bool:
        if self.compile is not None:
            return self.compile
        return self.resolved_attention() == "flex"


@dataclass
class TrainJob:
    """One training run on the warm engine (the service validates and fills this)."""

    datasets: list[str]
    output_dir: str
    steps: int | None = None
    epochs: float | None = None
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_accum: int = 1
    loss_gamma: float | None = None
    seed: int = 0
    checkpoint_interval: int = 100
    keep_checkpoints: int = 3
    init_from: str | None = None
    skip_bad_lines: bool = False
    # acceptance-length evaluation (held-out prompts)
    eval_prompts: str | None = None
    eval_fraction: float = 0.0
    eval_interval: int = 0
    eval_max_prompts: int = 16
    eval_max_new_tokens: int = 48
    # shapes: must equal the warmed engine's (None = take the engine's)
    seq_len: int | None = None
    num_anchors: int | None = None
    block_size: int | None = None

    def output_path(self) -> Path:
        return Path(self.output_dir)
