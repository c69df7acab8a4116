"""Gradient averaging across this host's drafter replicas (and, optionally, across hosts).

Narrow interface: `average(replica_grads)` leaves every replica holding the bit-identical mean.
Within a host the mean is computed once on the first replica's device (reduce) and copied back
to the others (broadcast), so identical inputs to identical optimizers keep replicas identical.
A torch.distributed process group, when given, all-reduces the host mean across hosts before
the broadcast (multi-host plugs in here without touching the drafter threads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GradSync:
    def __init__(self, process_group=None, guard: Callable[[str, Callable[[], Any]], Any] | None = None) -> None:
        """guard(what, call): runs the cross-host all-reduce (a multi-host group turns its failure
        into the job's readable, resumable error)."""
        self.process_group = process_group
        self.guard = guard

    @torch.no_grad()
    def average(self, grads_per_replica: list[list[torch.Tensor]]) -> None:
        """grads_per_replica[r][i] is gradient i of replica r (same shapes across r)."""
        self.finish(self.local_sum(grads_per_replica), grads_per_replica)

    @torch.no_grad()
    def local_sum(self, grads_per_replica: list[list[torch.Tensor]]) -> torch.Tensor | None:
        """This host's sum of the replicas' gradients, flat and fp32 on the first replica's device
        (None where there is nothing to average). Allocates: call it before a collective that
        must not wait for a rank whose allocation failed."""
        if len(grads_per_replica) == 1 and self.process_group is None:
            return None
        flat = torch._utils._flatten_dense_tensors(grads_per_replica[0]).float()
        for other in grads_per_replica[1:]:
            flat += torch._utils._flatten_dense_tensors(other).to(flat.device, torch.float32, non_blocking=True)
        return flat

    @torch.no_grad()
    def finish(self, flat: torch.Tensor | None, grads_per_replica: list[list[torch.Tensor]]) -> None:
        """The all-reduce across hosts (with a process group), the mean, and its copy into every
        replica's gradients."""
        if flat is None:
            return
        world = 1
        if self.process_group is not None:
            import torch.distributed as dist

            def reduce() -> None:
                dist.all_reduce(flat, group=self.process_group)

            if self.guard is not None:
                self.guard("the gradient all-reduce", reduce)
            else:
                reduce()
            world = dist.get_world_size(self.process_group)
        flat /= len(grads_per_replica) * world
        for grads in grads_per_replica:
            src = flat.to(grads[0].device, non_blocking=True)
            for g, s in zip(grads, torch._utils._unflatten_dense_tensors(src, grads)):
                g.copy_(s)
