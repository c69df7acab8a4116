"""A drafter that keeps up, measured on the embedded default (CPU): the target moves from v1 to a
v2 that answers differently, and a continual job brings the published drafter back.

    python -m bench.continual_drift [--seconds 120] [--out docs/img/continual_drift.svg]

1. v2: the embedded target (v1) fine-tuned on its own training conversations with the answers
   restyled (",": ";", "plus": "and", "equals": "is"), so it answers the same prompts differently.
2. The stale drafter: a training job on v1's data (the embedded default's), as a user has it.
3. The continual job: starts from the stale drafter, finds v2 in its target_watch and loads it in
   place, and is fed v2 traffic as prompts (the target answers them: `regenerate`); it publishes
   every few steps. Each published version's τ against v2 is measured afterwards on the held-out
   prompts, with the time it was published.
4. The from-scratch baseline: a drafter trained from scratch on v2's answers to the same prompts
   (a regeneration job with v2, then a training job), its τ against v2 and its training time.

Prints JSON lines and writes the plot of τ against time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

SHIFT = ((" , ", " ; "), (" plus ", " and "), (" equals ", " is "))
W, H, PAD = 640, 360, 48


def restyle(text: str) -> str:
    for old, new in SHIFT:
        text = text.replace(old, new)
    return text


def make_v2(v1: Path, train: Path, out: Path, steps: int) -> Path:
    """v1 fine-tuned on its training conversations with restyled answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_core.defaults.target import _lm_batches

    tokenizer = AutoTokenizer.from_pretrained(str(v1))
    model = AutoModelForCausalLM.from_pretrained(str(v1), dtype=torch.float32)
    conversations = []
    for line in train.read_text().splitlines():
        messages = json.loads(line)["messages"]
        conversations.append(
            [{**m, "content": restyle(m["content"])} if m["role"] == "assistant" else m for m in messages]
        )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = _lm_batches(tokenizer, conversations, 16, 160, torch.Generator().manual_seed(1))
    model.train()
    for _ in range(steps):
        x, m = next(batches)
        loss = model(input_ids=x, attention_mask=m, labels=x.masked_fill(m == 0, -100)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (v1 / name).is_file():
            shutil.copy(v1 / name, out / name)
    return out


def tau(checkpoint: str | Path, prompts: Path, target: Path, data: Path) -> float:
    from dflash_core.evaluate import evaluate_checkpoint

    summary = evaluate_checkpoint(
        str(checkpoint), str(prompts), target_path=str(target), max_prompts=32, max_new_tokens=48, data_dir=str(data)
    )
    return float(summary["acceptance_length"])


def prompts_file(train: Path, out: Path) -> Path:
    with out.open("w") as f:
        for line in train.read_text().splitlines():
            messages = json.loads(line)["messages"]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            f.write(json.dumps({"messages": messages[:first]}) + "\n")
    return out


def svg(points: list[tuple[float, float]], stale: float, scratch: float, scratch_seconds: float) -> str:
    xmax = max([p[0] for p in points] + [1.0]) * 1.05
    ymax = max([p[1] for p in points] + [stale, scratch]) * 1.1
    x = lambda t: PAD + (W - 2 * PAD) * t / xmax  # noqa: E731
    y = lambda v: H - PAD - (H - 2 * PAD) * v / ymax  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">seconds since the continual job started (v2 loaded)</text>',
        f'<text x="{PAD - 6}" y="{PAD}" text-anchor="end">{ymax:.1f}</text>',
        f'<text x="{PAD - 6}" y="{H - PAD}" text-anchor="end">0</text>',
        f'<text x="{W - PAD}" y="{H - PAD + 16}" text-anchor="end">{xmax:.0f}</text>',
        f'<line x1="{PAD}" y1="{y(stale):.1f}" x2="{W - PAD}" y2="{y(stale):.1f}" stroke="gray" stroke-dasharray="4"/>',
        f'<text x="{W - PAD}" y="{y(stale) - 4:.1f}" text-anchor="end" fill="gray">stale drafter vs v2: {stale:.2f}</text>',
        f'<line x1="{PAD}" y1="{y(scratch):.1f}" x2="{W - PAD}" y2="{y(scratch):.1f}" stroke="green" stroke-dasharray="4"/>',
        f'<text x="{W - PAD}" y="{y(scratch) - 4:.1f}" text-anchor="end" fill="green">from scratch on v2 '
        f"({scratch_seconds:.0f} s of training): {scratch:.2f}</text>",
    ]
    path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
    out.append(f'<polyline points="{path}" fill="none" stroke="blue" stroke-width="2"/>')
    out += [f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="3" fill="blue"/>' for t, v in points]
    out.append(
        f'<text x="{PAD + 8}" y="{PAD + 12}" fill="blue">published drafter vs v2 (tau on held-out prompts)</text>'
    )
    return "\n".join([*out, "</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120, help="how long the continual job runs")
    parser.add_argument("--v2-steps", type=int, default=80)
    parser.add_argument("--out", default="docs/img/continual_drift.svg")
    args = parser.parse_args(argv)
    from dflash_core.continual.job import ContinualJob
    from dflash_core.defaults import DEFAULT_TRAIN_STEPS, ensure_default_assets
    from dflash_core.engine import Engine, EngineConfig, JobCallbacks, TrainJob
    from dflash_core.regenerate.job import RegenerateJob

    def report(**values) -> None:
        print(json.dumps(values), flush=True)

    with tempfile.TemporaryDirectory(prefix="dflash-drift-") as tmp:
        work = Path(tmp)
        data = work / "data"
        assets = ensure_default_assets(data)
        t0 = time.monotonic()
        watch = work / "policy"
        watch.mkdir()
        v2 = make_v2(assets.target, assets.train, work / "v2", args.v2_steps)
        report(step="v2", seconds=round(time.monotonic() - t0, 1))

        engine = Engine(EngineConfig(drafter_devices=["cpu"]), data).build()
        t0 = time.monotonic()
        stale = work / "stale"
        result = engine.run_job(
            TrainJob(
                datasets=[str(assets.train)],
                output_dir=str(stale),
                steps=DEFAULT_TRAIN_STEPS,
                checkpoint_interval=DEFAULT_TRAIN_STEPS,
            )
        )
        assert result.final_checkpoint
        stale_v1, stale_v2 = (tau(result.final_checkpoint, assets.heldout, t, data) for t in (assets.target, v2))
        report(step="stale drafter", train_seconds=round(time.monotonic() - t0, 1), tau_v1=stale_v1, tau_v2=stale_v2)

        shutil.copytree(v2, watch / ".v2")
        (watch / ".v2").rename(watch / "v2")
        source = work / "traffic"
        source.mkdir()
        prompts_file(assets.train, source / "prompts.jsonl")
        published: list[tuple[float, dict]] = []
        began = time.monotonic()

        class Callbacks(JobCallbacks):
            def on_publish(self, result) -> None:
                if result.get("published"):
                    published.append((time.monotonic() - began, result))

            def should_cancel(self) -> bool:
                return time.monotonic() - began > args.seconds

        job = ContinualJob(
            datasets=[],
            output_dir=str(work / "continual"),
            sources=[str(source)],
            init_from=str(result.final_checkpoint),
            target_watch=str(watch),
            regenerate={"max_new_tokens": 48, "slots": 16},
            publish_dir=str(work / "continual" / "published"),
            publish_every_steps=10,
            keep_versions=1000,
            heldout_every=8,
            eval_max_prompts=8,
            eval_max_new_tokens=32,
            checkpoint_interval=50,
            replay_ratio=0.25,
            poll_seconds=0.5,
        )
        engine.run_job(job, Callbacks())
        points = [(0.0, stale_v2)] + [(round(t, 1), tau(r["path"], assets.heldout, v2, data)) for t, r in published]
        report(step="continual", published=[{"seconds": t, "tau_v2": v} for t, v in points])
        engine.close()

        engine2 = Engine(EngineConfig(target_path=v2, drafter_devices=["cpu"]), data).build()
        answers = work / "v2-answers"
        engine2.run_job(
            RegenerateJob(datasets=[str(source / "prompts.jsonl")], output_dir=str(answers), max_new_tokens=48)
        )
        t0 = time.monotonic()
        scratch = engine2.run_job(
            TrainJob(
                datasets=[str(answers)],
                output_dir=str(work / "scratch"),
                steps=DEFAULT_TRAIN_STEPS,
                checkpoint_interval=DEFAULT_TRAIN_STEPS,
            )
        )
        scratch_seconds = time.monotonic() - t0
        assert scratch.final_checkpoint
        scratch_tau = tau(scratch.final_checkpoint, assets.heldout, v2, data)
        report(step="from scratch on v2", train_seconds=round(scratch_seconds, 1), tau_v2=scratch_tau)
        engine2.close()
        best = next(((t, v) for t, v in points[1:] if v >= 0.95 * scratch_tau), None)
        report(
            goal="published tau >= 95 % of from-scratch within 10 % of its time",
            reached_at_seconds=best[0] if best else None,
            from_scratch_seconds=round(scratch_seconds, 1),
            met=bool(best and best[0] <= 0.1 * scratch_seconds),
        )
        Path(args.out).write_text(svg(points, stale_v2, scratch_tau, scratch_seconds))


if __name__ == "__main__":
    main()
