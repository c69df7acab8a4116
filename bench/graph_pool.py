"""The regeneration decoder's recorded steps and their memory: one pool for all of them against a
pool per graph, in one run.

The decoder (dflash_core/regenerate/decode.py) records its decode step once per sampling mode and
riding width (ride.py: the riding rows, then each a quarter of the width before). This records
the greedy mode's graphs, widest first and the plain step last, on a target of `--layers` layers
of Qwen3-8B's widths (random bf16 weights, cuda:0), and prints the reserved memory each graph
added (the allocator's cache emptied before and after each recording, so what remains is the
graph's own): `shared`, the decoder as it runs (one pool and one capture stream for all its
graphs); `private`, a pool of its own per graph, as separate captures without a pool argument
would have.

    python -m bench.graph_pool [--layers 4] [--slots 256] [--ride 512] [--length 1024]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import QWEN3_8B, env_record, report, write_target_dir
from bench.tables import columns_of
from dflash_core.regenerate.decode import Sampling, SlotDecoder
from dflash_core.target import TargetModel


def reserved_after(record) -> int:
    """Reserved bytes that `record()` added and kept, the allocator's cache emptied around it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    record()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - before


def graph_memory(model, slots: int, length: int, ride: int, pools: str) -> dict:
    """One row: the MiB each greedy graph of a fresh decoder added, widest first, plain step last."""
    dec = SlotDecoder(model, slots=slots, length=length, ride_rows=ride)
    dec._set_sampling(Sampling())
    added = {}
    for width in (*dec.ride_widths, 0):
        if pools == "private":
            dec._pool = torch.cuda.graph_pool_handle()

        def record(width=width):
            with torch.no_grad():
                dec._graphs[("greedy", width)] = dec._record("greedy", width)

        added[width] = reserved_after(record) / 2**20
    row = {"pools": pools, "slots": slots, "ride_widths": "/".join(map(str, dec.ride_widths))}
    row.update({f"width_{w}_mib" if w else "plain_mib": round(mib, 1) for w, mib in added.items()})
    row["total_mib"] = round(sum(added.values()), 1)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4, help="decoder layers of Qwen3-8B's widths")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--ride", type=int, default=512, help="the riding rows (the widest width)")
    p.add_argument("--length", type=int, default=1024, help="cache positions per slot")
    args = p.parse_args(argv)
    if min(args.layers, args.slots, args.ride, args.length) < 1:
        p.error("--layers, --slots, --ride and --length take positive counts")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    target_dir = write_target_dir(Path(tempfile.mkdtemp()) / "target", QWEN3_8B, num_hidden_layers=args.layers)
    model = TargetModel(target_dir, [0], "cuda:0", random_init=True).model
    rows = []
    for pools in ("shared", "private"):
        rows.append(graph_memory(model, args.slots, args.length, args.ride, pools))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    report(
        "graph_pool",
        {"env": env_record(), "args": vars(args), "rows": rows},
        f"reserved MiB per recorded greedy graph, {args.layers} layers of Qwen3-8B's widths (bf16), "
        f"{args.slots} slots of {args.length} positions",
        rows,
        columns_of(rows),
    )


if __name__ == "__main__":
    main()
