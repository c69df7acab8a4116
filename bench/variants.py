"""Step variants the benchmarks compare against the engine's plan. None of them is a setting of
the daemon: the engine derives its plan from the devices (dflash_core.engine.config.step_plan).

compile scope: "layer" is the engine's (one compiled decoder layer serves every layer, plus the
    compiled BlockMask and loss chunks); "attention" compiles flex_attention alone (layers eager);
    "step" compiles the whole drafter forward (a far longer cold compile).
q_splits: the queries as this many flex batch entries against one broadcast K, V.
attention "dense" / "dense_chunked": SDPA with a dense mask, whole or in query chunks (the
    baselines of the flex path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.engine.config import StepPlan
from dflash_core.engine.replica import compiled_run_layer
from dflash_core.step.attention import DENSE_KINDS, DenseAttention
from dflash_core.step.micro_step import StepKernels

COMPILE_SCOPES = ("attention", "layer", "step")


@dataclass
class ChunkedDenseAttention:
    """SDPA over chunks of queries, each with its slice of the dense mask: bounds the mask and
    score memory per call. It swings reserved memory and loses throughput; the engine never
    uses it, and it stays as the baseline the benchmarks compare against."""

    mask: torch.Tensor
    chunk: int = 1024

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dense = DenseAttention(None)
        outs = []
        for start in range(0, q.shape[2], self.chunk):
            dense.mask = self.mask[start : start + self.chunk]
            outs.append(dense(q[:, :, start : start + self.chunk], k, v))
        return torch.cat(outs, dim=2)


DENSE_KINDS["dense_chunked"] = ChunkedDenseAttention  # a plan's attention="dense_chunked"


def variant_kernels(drafter: DFlashDrafter, plan: StepPlan, scope: str = "layer", q_splits: int = 1) -> StepKernels:
    """The compiled parts of a step for a plan, at another compile scope or query split."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    if not plan.compiled:
        return StepKernels(q_splits=q_splits, loss=plan.loss)
    fused = scope in ("layer", "step")
    loss = plan.loss if plan.loss == "triton" or fused else "eager"
    return StepKernels(
        attention=plan.attention == "flex" and scope == "attention",  # otherwise compiled with the layer/forward
        forward=torch.compile(drafter.forward, dynamic=False) if scope == "step" else None,
        layer=compiled_run_layer(plan.precision) if scope == "layer" else None,
        mask=fused and plan.attention == "flex",
        loss=loss,
        q_splits=q_splits,
    )
