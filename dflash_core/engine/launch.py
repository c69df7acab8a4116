"""Where this process sits in a multi-host group, from the launcher's environment (torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Imports nothing heavy: the daemon reads
it before torch is imported."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the group, as the launcher's environment says."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Launch | None:
        """The launch described by torchrun's variables; None when WORLD_SIZE is unset or 1 (one process)."""
        env = dict(os.environ) if env is None else env
        if env.get("WORLD_SIZE", "1").strip() in ("", "1"):
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with torchrun")
        try:
            launch = cls(
                rank=int(env["RANK"]),
                world=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as e:
            raise ValueError(f"invalid launch environment: {e}") from None
        if not 0 <= launch.rank < launch.world:
            raise ValueError(f"RANK={launch.rank} is outside WORLD_SIZE={launch.world}")
        return launch
