"""τ of DFlash and DSpark drafters on a real pretrained target, SmolLM2-135M-Instruct, at equal
drafted tokens per block (fill_in block 8 = anchor_first block 7 = 7 drafts).

    python -m bench.smollm2_tau --device cuda:0 [--gguf FILE | --target DIR] [--steps 800]
                                [--seeds 0,1,2] [--arms dflash_b8,dflash_af7,dspark,dspark_warm]

1. The target regenerates its own training data with the daemon's regeneration job, sampling as
   DeepSpec's data recipe does (temperature 0.7, top-p 0.8, top-k 20), from chat prompts built
   from templates and topics (`chat_prompts`); the held-out prompts use topics no training prompt
   has.
2. Per arm and seed, one training job from the same seed's initial draw:
     dflash_b8    DFlash, CE, fill_in, block 8, the DFlash decay (gamma 4 at block 8)
     dflash_af7   DFlash, CE, anchor_first, block 7, gamma 4 (DeepSpec's DFlash baseline)
     dspark       DSpark, the public recipe (anchor_first, block 7, gamma 4, 0.1 CE + 0.9 L1 + 1 BCE)
     dspark_warm  DSpark warm-started from the same seed's dflash_b8 checkpoint (backbone; heads fresh)
     dspark_fill_in  DSpark as the daemon trained it before the public recipe (fill_in block 7:
                  6 drafts; uniform weights, TV 0.9), for its step cost (not in the default arms)
3. τ on the held-out prompts: greedy (speculative decoding checked by the target) and at
   temperature 1 (speculative sampling); the median step time of each arm after its first steps.

Prints a table; writes $OUT/smollm2_tau.json as rows finish (a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from dflash_core.engine.api import JobCallbacks

ARMS = {  # name -> (engine settings, job fields)
    "dflash_b8": ({"recipe": "dflash", "block_size": 8}, {}),
    "dflash_af7": ({"recipe": "dflash", "block_size": 7, "layout": "anchor_first"}, {"loss_gamma": 4.0}),
    "dspark": ({"recipe": "dspark"}, {}),
    "dspark_warm": ({"recipe": "dspark"}, {"init_from": "dflash_b8"}),
    # the DSpark recipe as the daemon trained it before it took the public one (fill_in, uniform
    # position weights, TV at 0.9): its step cost and tau beside the public recipe's
    "dspark_fill_in": (
        {"recipe": "dspark", "layout": "fill_in"},
        {"loss": {"ce": 0.1, "tv": 0.9, "conf": 1.0}, "loss_gamma": float("inf")},
    ),
}

TEMPLATES = (
    "Explain {t} to a beginner.",
    "Write a short poem about {t}.",
    "Give me three practical tips about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Summarize what you know about {t} in a few sentences.",
    "Write a friendly email inviting a colleague to a talk on {t}.",
    "List five interesting facts about {t}.",
    "How would you teach {t} to a ten-year-old?",
    "Write a short story in which {t} plays a central role.",
    "What questions should I ask an expert in {t}?",
)
TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "volcanoes",
    "the Roman empire",
    "chess openings",
    "baking bread",
    "learning a new language",
    "saving money",
    "running a marathon",
    "climate change",
    "machine learning",
    "the human heart",
    "honey bees",
    "electric cars",
    "public speaking",
    "gardening",
    "the French revolution",
    "recycling",
    "meditation",
    "coffee",
    "jazz music",
    "the moon landing",
    "healthy sleep",
    "time management",
    "octopuses",
    "the printing press",
    "solar panels",
    "friendship",
    "rainforests",
    "the stock market",
    "ancient Egypt",
    "bicycles",
    "earthquakes",
    "vaccines",
    "origami",
    "penguins",
    "the internet",
    "libraries",
    "mountain climbing",
    "tea ceremonies",
    "renewable energy",
    "the Olympic games",
    "dinosaurs",
    "wind turbines",
    "knitting",
    "the periodic table",
    "coral reefs",
    "video games",
    "Shakespeare",
    "camping",
    "bridges",
    "the immune system",
    "cats",
    "street food",
    "rivers",
    "glaciers",
    "kites",
    "the violin",
    "trains",
)
HELDOUT_TOPICS = (
    "lighthouses",
    "submarines",
    "sourdough starters",
    "the Silk Road",
    "hummingbirds",
    "thunderstorms",
    "board games",
    "the Great Wall of China",
    "composting",
    "telescopes",
    "jellyfish",
    "pottery",
)


def chat_prompts(topics, n: int, seed: int) -> list[dict]:
    """n distinct single-turn chats drawn from TEMPLATES x topics."""
    pairs = [(t, topic) for t in TEMPLATES for topic in topics]
    random.Random(seed).shuffle(pairs)
    return [{"messages": [{"role": "user", "content": t.format(t=topic)}]} for t, topic in pairs[:n]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class StepLog(JobCallbacks):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def on_step(self, stats) -> None:
        self.losses.append(round(float(stats.loss), 4))
        self.seconds.append(float(stats.step_seconds))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument(
        "--gguf", default=None, help="build the target from this GGUF file (else --target, else the package's)"
    )
    p.add_argument("--target", default=None, help="an HF directory of SmolLM2 (dflash_core.targets.smollm2)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default="dflash_b8,dflash_af7,dspark,dspark_warm")
    p.add_argument("--train-prompts", type=int, default=len(TEMPLATES) * len(TOPICS))
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--drafter-layers", type=int, default=3)
    p.add_argument("--learning-rate", type=float, default=1.5e-3)
    p.add_argument("--markov-rank", type=int, default=None)
    p.add_argument("--debug-eager", action="store_true")
    args = p.parse_args(argv)

    from bench.common import out_dir
    from dflash_core.engine import Engine, EngineConfig, TrainJob
    from dflash_core.evaluate import evaluate_acceptance
    from dflash_core.evaluate_sampled import sampled_acceptance_length
    from dflash_core.regenerate.job import RegenerateJob
    from dflash_core.targets.smollm2 import build

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="smollm2-tau-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    target = (
        Path(args.target)
        if args.target
        else build(data_dir / "targets" / "smollm2", Path(args.gguf) if args.gguf else None)
    )
    prompts = write_jsonl(data_dir / "prompts.jsonl", chat_prompts(TOPICS, args.train_prompts, 0))
    heldout = [c["messages"] for c in chat_prompts(HELDOUT_TOPICS, args.eval_prompts, 1)]
    out = out_dir() / "smollm2_tau.json"
    rows: list[dict] = []
    report: dict = {"args": vars(args), "rows": rows}

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    arms = args.arms.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    engines: dict[str, list[str]] = {}
    for name in arms:
        engines.setdefault(json.dumps(ARMS[name][0], sort_keys=True), []).append(name)
    regenerated = data_dir / "regenerated"
    checkpoints: dict[tuple[str, int], str] = {}
    for settings_key, names in engines.items():
        settings = json.loads(settings_key)
        t0 = time.monotonic()
        cfg = EngineConfig(
            target_path=target,
            target_devices=[args.device],
            drafter_devices=[args.device],
            seq_len=args.seq_len,
            num_anchors=args.anchors,
            drafter_layers=args.drafter_layers,
            debug_eager=args.debug_eager,
            **({"markov_rank": args.markov_rank} if args.markov_rank and settings["recipe"] == "dspark" else {}),
            **settings,
        )
        engine = Engine(cfg, data_dir).build()
        report.setdefault("builds", {})[",".join(names)] = round(time.monotonic() - t0, 1)
        print(json.dumps({"engine": settings, "build_s": round(time.monotonic() - t0, 1)}), flush=True)
        try:
            if not regenerated.exists():
                t1 = time.monotonic()
                engine.run_job(
                    RegenerateJob(
                        datasets=[str(prompts)],
                        output_dir=str(regenerated),
                        max_new_tokens=args.new_tokens,
                        temperature=0.7,
                        top_p=0.8,
                        top_k=20,
                        samples_per_prompt=args.samples_per_prompt,
                    )
                )
                report["regeneration_s"] = round(time.monotonic() - t1, 1)
                print(json.dumps({"regeneration_s": report["regeneration_s"]}), flush=True)
                save()
            for name in names:
                for seed in seeds:
                    job_fields = dict(ARMS[name][1])
                    if "init_from" in job_fields:
                        source = checkpoints.get((job_fields["init_from"], seed))
                        if source is None:
                            print(json.dumps({"skipped": name, "seed": seed, "why": "no source checkpoint"}))
                            continue
                        job_fields["init_from"] = source
                    log = StepLog()
                    t1 = time.monotonic()
                    res = engine.run_job(
                        TrainJob(
                            datasets=[str(regenerated)],
                            output_dir=str(data_dir / "jobs" / f"{name}-{seed}"),
                            steps=args.steps,
                            seed=seed,
                            learning_rate=args.learning_rate,
                            checkpoint_interval=args.steps,
                            keep_checkpoints=1,
                            **job_fields,
                        ),
                        log,
                    )
                    train_s = time.monotonic() - t1
                    if res.final_checkpoint:
                        checkpoints[(name, seed)] = res.final_checkpoint
                    rep = engine.replicas[0]
                    t2 = time.monotonic()
                    greedy = evaluate_acceptance(
                        engine.targets[0],
                        rep.drafter,
                        engine.tokenizer,
                        heldout,
                        max_new_tokens=args.eval_tokens,
                        head=rep.head,
                    )
                    sampled = sampled_acceptance_length(
                        engine.targets[0],
                        rep.drafter,
                        rep.head,
                        engine.tokenizer,
                        heldout,
                        temperature=1.0,
                        max_new_tokens=args.eval_tokens,
                        seed=seed,
                    )
                    warm = log.seconds[min(20, len(log.seconds) // 2) :] or log.seconds
                    row = {
                        "arm": name,
                        "seed": seed,
                        "tau_greedy": round(greedy.acceptance_length, 3),
                        "tau_t1": round(sampled, 3),
                        "step_ms": round(1000 * statistics.median(warm), 2),
                        "train_s": round(train_s, 1),
                        "eval_s": round(time.monotonic() - t2, 1),
                        "loss_first_last": [log.losses[0], log.losses[-1]] if log.losses else None,
                        "loss_every_50": log.losses[::50],
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save()
        finally:
            engine.close()
    table = {}
    for name in arms:
        mine = [r for r in rows if r["arm"] == name]
        if not mine:
            continue
        g, t, s = ([r[k] for r in mine] for k in ("tau_greedy", "tau_t1", "step_ms"))
        table[name] = {
            "greedy_mean": round(statistics.mean(g), 3),
            "greedy_std": round(statistics.pstdev(g), 3),
            "t1_mean": round(statistics.mean(t), 3),
            "t1_std": round(statistics.pstdev(t), 3),
            "step_ms": round(statistics.median(s), 2),
            "seeds": len(mine),
        }
    report["table"] = table
    save()
    print("\n| arm | τ greedy | spread | τ at T=1 | spread | step ms | seeds |\n|---|---|---|---|---|---|---|")
    for name, t in table.items():
        print(
            f"| {name} | {t['greedy_mean']:.3f} | {t['greedy_std']:.3f} | {t['t1_mean']:.3f} | {t['t1_std']:.3f} "
            f"| {t['step_ms']:.2f} | {t['seeds']} |"
        )


if __name__ == "__main__":
    main()
