"""Loss curves of bench.objectives_tau's runs overlaid, as an SVG for docs/performance.md.

    python -m bench.loss_curves out/objectives_tau_fp8.json docs/img/fp8_loss_curves.svg [--smooth 10]

One line per run and seed (each run its colour), the loss at every step smoothed by a trailing
mean of --smooth steps. Plain SVG: no plotting library needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
WIDTH, HEIGHT, PAD = 640, 360, 48


def smoothed(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def svg(rows: list[dict], window: int) -> str:
    curves = [(r["run"], r["seed"], smoothed(r["loss"], window)) for r in rows if r.get("loss")]
    steps = max(len(c) for _, _, c in curves)
    top = max(max(c) for _, _, c in curves)
    runs = list(dict.fromkeys(run for run, _, _ in curves))

    def point(i: int, v: float) -> str:
        x = PAD + (WIDTH - 2 * PAD) * i / max(steps - 1, 1)
        y = HEIGHT - PAD - (HEIGHT - 2 * PAD) * v / top
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle">step (loss: trailing mean of {window})</text>',
        f'<text x="{PAD - 6}" y="{PAD}" text-anchor="end">{top:.1f}</text>',
        f'<text x="{PAD - 6}" y="{HEIGHT - PAD}" text-anchor="end">0</text>',
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="end">{steps}</text>',
    ]
    for run, seed, curve in curves:
        colour = COLOURS[runs.index(run) % len(COLOURS)]
        points = " ".join(point(i, v) for i, v in enumerate(curve))
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" opacity="0.8" points="{points}"><title>{run} seed {seed}</title></polyline>'
        )
    for k, run in enumerate(runs):
        y = PAD + 16 * k
        colour = COLOURS[k % len(COLOURS)]
        parts.append(
            f'<line x1="{WIDTH - PAD - 120}" y1="{y}" x2="{WIDTH - PAD - 100}" y2="{y}" stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{WIDTH - PAD - 94}" y="{y + 4}">{run}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("results", help="objectives_tau's JSON (rows with a loss per step)")
    p.add_argument("svg")
    p.add_argument("--smooth", type=int, default=10)
    args = p.parse_args(argv)
    rows = json.loads(Path(args.results).read_text())["rows"]
    Path(args.svg).write_text(svg(rows, args.smooth))


if __name__ == "__main__":
    main()
