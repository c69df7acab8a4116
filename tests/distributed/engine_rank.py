"""One rank of an engine-level multi-process test, started by torchrun (tests/test_distributed.py).

Every rank builds an engine on the CPU in its own data dir and joins the group; rank 0 runs the
jobs given as a JSON list, one after the other in the same group, and writes each one's result
(its step losses or its error, and how long it took), then tells the others to stop; every rank
writes its replicas' weights as the last job left them. With "diverge_rank_1_at_step" in a job,
rank 1 changes a weight after that step of that job (what the ranks' checksum comparison must
catch). Usage: torchrun ... -m tests.distributed.engine_rank OUT_DIR JOBS_JSON
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_core.defaults import DEFAULT_DRAFTER_LAYERS, DEFAULT_TARGET_LAYER_IDS
from dflash_core.engine import Engine, EngineConfig, JobCallbacks, JobError, TrainJob
from dflash_core.engine.distributed import Launch, RankGroup


class Losses(JobCallbacks):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.events: list[tuple[str, dict]] = []

    def on_step(self, stats) -> None:
        self.losses.append(stats.loss)

    def on_event(self, kind, payload) -> None:
        self.events.append((kind, payload))


def main() -> int:
    out, specs = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    launch = Launch.from_env()
    assert launch is not None
    group = RankGroup(launch, timeout_seconds=60)
    config = EngineConfig(
        drafter_devices=["cpu"],
        seq_len=256,
        num_anchors=32,
        block_size=8,
        drafter_layers=DEFAULT_DRAFTER_LAYERS,
        target_layer_ids=list(DEFAULT_TARGET_LAYER_IDS),
    )
    engine = Engine(config, out / f"data-{launch.rank}", group=group).build()
    # a test of the weight checksums: the step of each job (in order) after which rank 1 drifts
    diverge_at = [spec.pop("diverge_rank_1_at_step", None) for spec in specs]
    result: dict = {"rank": launch.rank}
    if group.is_leader:
        deadline = time.monotonic() + 60
        while group.ranks_ready() < group.world and time.monotonic() < deadline:
            time.sleep(0.1)
        result["jobs"] = []
        for spec in specs:
            rec, started = Losses(), time.monotonic()
            try:
                res = engine.run_job(TrainJob(**spec), rec)
                done = dict(status=res.status, steps=res.steps_done, losses=rec.losses)
            except JobError as e:
                done = dict(status="FAILED", error=e.message, resumable=e.resumable, losses=rec.losses)
            result["jobs"].append({**done, "seconds": time.monotonic() - started})
        group.post({"kind": "shutdown"})
    else:
        followed = iter(diverge_at)

        def follower() -> JobCallbacks:  # one per job rank 0 sends, in the order of the list
            at = next(followed)

            class Follower(JobCallbacks):
                def on_step(self, stats) -> None:  # this rank's weights drift from rank 0's
                    if stats.step == at:
                        with torch.no_grad():
                            next(iter(engine.replicas[0].masters)).add_(1e-3)

            return Follower()

        result["ended"] = engine.follow(threading.Event(), follower)
    weights = {k: v.contiguous() for k, v in engine.replicas[0].weights_state().items()}
    save_file(weights, str(out / f"rank{launch.rank}.safetensors"))
    (out / f"rank{launch.rank}.json").write_text(json.dumps(result))
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
