"""Gradient averaging across this host's drafter replicas (and, optionally, across hosts).

Narrow interface: `average(replica_grads)` leaves every replica holding the bit-identical mean.
Within a host the mean is computed once on the first replica's device (reduce) and copied back
to the others (broadcast), so identical inputs to identical optimizers keep replicas identical.
A torch.distributed process group, when given, all-reduces the host mean across hosts before
the broadcast (multi-host plugs in here without touching the drafter threads).
"""

from __future__ import annotations

import torch


class GradSync:
    def __init__(self, process_group=None) -> None:
        self.process_group = process_group

    @torch.no_grad()
    def average(self, grads_per_replica: list[list[torch.Tensor]]) -> None:
        """grads_per_replica[r][i] is gradient i of replica r (same shapes across r)."""
        replicas = len(grads_per_replica)
        root = grads_per_replica[0]
        if replicas > 1 or self.process_group is not None:
            flat = torch._utils._flatten_dense_tensors(root).float()
            for other in grads_per_replica[1:]:
                flat += torch._utils._flatten_dense_tensors(other).to(flat.device, torch.float32, non_blocking=True)
            world = 1
            if self.process_group is not None:
                import torch.distributed as dist

                dist.all_reduce(flat, group=self.process_group)
                world = dist.get_world_size(self.process_group)
            flat /= replicas * world
            for grads in grads_per_replica:
                src = flat.to(grads[0].device, non_blocking=True)
                for g, s in zip(grads, torch._utils._unflatten_dense_tensors(src, grads)):
                    g.copy_(s)
