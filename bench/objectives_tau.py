"""Acceptance length (tau) of each objective on the embedded default, same steps, several seeds.

    python -m bench.objectives_tau [--device cpu|cuda:0] [--steps 150] [--seeds 0,1,2]
                                   [--runs ce,dpace,kl,tv,ce_tv,ce_b7,dspark] (also dspark_ce_tv, dspark_ce)

One engine per (recipe, block size), warmed once, trains a job per objective and seed from the
same initial weights of that seed, and measures greedy tau on the held-out prompts at the end
(evaluate.py: speculative decoding checked by the target, Markov sampling inside the block for
DSpark; with --temperature T also tau by speculative sampling at T, evaluate_sampled.py). ce_b7 is DFlash CE at DSpark's block size 7 (like for like with dspark). Prints a table of
mean and spread (population standard deviation) per run and writes $OUT/objectives_tau<tag>.json (rows as they finish).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dflash_core.engine.api import JobCallbacks

RUNS = {  # name -> (engine key, job fields)
    "ce": ("b8", {}),
    "dpace": ("b8", {"position_weights": "dpace"}),
    "kl": ("b8", {"loss": {"kl": 1.0}}),
    "tv": ("b8", {"loss": {"tv": 1.0}}),
    "ce_tv": ("b8", {"loss": {"ce": 0.1, "tv": 0.9}}),
    "ce_b7": ("b7", {}),
    "dspark": ("dspark", {}),
    # ablations: the DSpark heads with more CE in the mix
    "dspark_ce_tv": ("dspark", {"loss": {"ce": 1.0, "tv": 0.9, "conf": 1.0}}),
    "dspark_ce": ("dspark", {"loss": {"ce": 1.0, "conf": 1.0}}),
    # the drafter's precision (CE, no teacher): bf16 against FP8 GEMMs (CUDA with FP8 matmuls)
    "ce_bf16": ("bf16", {}),
    "ce_fp8": ("fp8", {}),
}
ENGINES = {
    "b8": {"teacher": True},
    "b7": {"teacher": True, "block_size": 7},
    "dspark": {"recipe": "dspark"},
    "bf16": {},
    "fp8": {"precision": "fp8"},
}


class LossCurve(JobCallbacks):
    """The job's loss at every step, for the curves of the performance page."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step(self, stats) -> None:
        self.losses.append(round(float(stats.loss), 4))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs", default="ce,dpace,kl,tv,ce_tv,ce_b7,dspark")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="which engines of ENGINES to build (one process each, in parallel)"
    )
    p.add_argument("--debug-eager", action="store_true", help="the engine's eager step (no compile; same math)")
    p.add_argument("--tag", default="", help="suffix of the output file")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="also tau by speculative sampling at this temperature (0: no)"
    )
    args = p.parse_args(argv)
    from bench.common import out_dir
    from dflash_core.data.conversations import read_conversations
    from dflash_core.defaults import ensure_default_assets
    from dflash_core.engine import Engine, EngineConfig, TrainJob
    from dflash_core.evaluate_sampled import sampled_acceptance_length

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="objectives-tau-"))
    assets = ensure_default_assets(data_dir)
    names = args.runs.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[float]] = {n: [] for n in names}
    results_t: dict[str, list[float]] = {n: [] for n in names}
    heldout = list(read_conversations(assets.heldout))
    rows = []
    for key, settings in ENGINES.items():
        if key not in args.engines.split(","):
            continue
        wanted = [n for n in names if RUNS[n][0] == key]
        if not wanted:
            continue
        t0 = time.monotonic()
        cfg = EngineConfig(
            target_devices=[args.device], drafter_devices=[args.device], debug_eager=args.debug_eager, **settings
        )
        engine = Engine(cfg, data_dir).build()
        print(json.dumps({"engine": key, "build_s": round(time.monotonic() - t0, 1)}), flush=True)
        try:
            for name in wanted:
                for seed in seeds:
                    t1 = time.monotonic()
                    job = TrainJob(
                        datasets=[str(assets.train)],
                        output_dir=str(data_dir / "jobs" / f"{name}-{seed}"),
                        steps=args.steps,
                        seed=seed,
                        learning_rate=args.learning_rate,
                        checkpoint_interval=10**9,
                        eval_prompts=str(assets.heldout),
                        eval_interval=args.steps,
                        eval_max_prompts=args.eval_prompts,
                        eval_max_new_tokens=args.eval_tokens,
                        **RUNS[name][1],
                    )
                    curve = LossCurve()
                    res = engine.run_job(job, curve)
                    tau = float(res.eval["acceptance_length"])
                    results[name].append(tau)
                    row = {"run": name, "seed": seed, "tau": round(tau, 3), "seconds": round(time.monotonic() - t1, 1)}
                    row["loss"] = curve.losses
                    if args.temperature:
                        rep = engine.replicas[0]
                        tau_t = sampled_acceptance_length(
                            engine.targets[0],
                            rep.drafter,
                            rep.head,
                            engine.tokenizer,
                            heldout[: args.eval_prompts],
                            temperature=args.temperature,
                            max_new_tokens=args.eval_tokens,
                            seed=seed,
                        )
                        results_t[name].append(tau_t)
                        row["tau_sampled"] = round(tau_t, 3)
                    if res.eval.get("confidence_calibration"):
                        row["calibration"] = res.eval["confidence_calibration"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    (out_dir() / f"objectives_tau{args.tag}.json").write_text(json.dumps({"rows": rows}, indent=1))
        finally:
            engine.close()
    table = {
        n: {"mean": round(statistics.mean(v), 3), "std": round(statistics.pstdev(v), 3), "taus": v}
        | (
            {
                "sampled_mean": round(statistics.mean(results_t[n]), 3),
                "sampled_std": round(statistics.pstdev(results_t[n]), 3),
                "sampled": results_t[n],
            }
            if results_t[n]
            else {}
        )
        for n, v in results.items()
        if v
    }
    (out_dir() / f"objectives_tau{args.tag}.json").write_text(
        json.dumps({"args": vars(args), "table": table, "rows": rows}, indent=1)
    )
    print("\n| run | tau mean | spread (std) | sampled tau mean | spread | seeds |\n|---|---|---|---|---|---|")
    for n, t in table.items():
        sampled = f"{t['sampled_mean']:.3f} | {t['sampled_std']:.3f}" if "sampled" in t else "- | -"
        print(f"| {n} | {t['mean']:.3f} | {t['std']:.3f} | {sampled} | {len(t['taus'])} |")


if __name__ == "__main__":
    main()
