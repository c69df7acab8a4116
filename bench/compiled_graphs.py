"""What a compile cache holds, graph by graph: each compiled graph's output code (the Python module
inductor writes into its cache directory), whether it is an inference graph, a training forward
or a backward, how many kernels it generates, and their names' stems (inductor names a kernel
after the ops it fuses, so the stems say what the kernels do). Where a cold start's kernels come
from, for instance the daemon's after `bench.daemon_gpu` (its cache is <DAEMON_WORK>/inductor):

    python -m bench.compiled_graphs /tmp/dflash-daemon-gpu/inductor --stems 12

The file is named by a hash of its code: a graph whose output code is written twice (compiled,
then loaded in another process), or two graphs whose code is the same, show as one module.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# a generated kernel's definition in the output code: Triton on a GPU, C++ on the CPU
KERNEL = re.compile(r"^(\w+) = async_compile\.(?:triton|cpp_pybinding|cpp)\(", re.M)


@dataclass(frozen=True)
class Graph:
    path: Path  # the output code, relative to the cache directory
    kind: str  # "inference", "forward" (of a training graph) or "backward"
    kernels: tuple[str, ...]

    def stems(self) -> Counter[str]:
        """The kernels' names without their running number: kernels of the same ops at other
        shapes or strides share a stem."""
        return Counter(re.sub(r"_\d+$", "", name) for name in self.kernels)


def graph_kind(code: str) -> str:
    """AOTAutograd names a backward graph's incoming gradients `tangents_*` and a training
    forward's inputs `primals_*`; an inference graph has neither."""
    if "tangents_" in code:
        return "backward"
    return "forward" if "primals_" in code else "inference"


def inventory(cache: Path) -> list[Graph]:
    """The compiled graphs whose output code is under `cache`, most kernels first by kind."""
    graphs = []
    for path in sorted(cache.rglob("*.py")):
        try:
            code = path.read_text(errors="replace")
        except OSError:  # removed while read, a dangling link: not a module this run can read
            continue
        if "def call(" not in code or "async_compile" not in code:
            continue  # a kernel's own source, or another cache's module
        kernels = tuple(m.group(1) for m in KERNEL.finditer(code))
        graphs.append(Graph(path.relative_to(cache), graph_kind(code), kernels))
    return sorted(graphs, key=lambda g: (g.kind, -len(g.kernels), str(g.path)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", type=Path, help="an inductor cache directory (TORCHINDUCTOR_CACHE_DIR)")
    p.add_argument("--stems", type=int, default=10, help="the most common kernel stems listed per graph")
    args = p.parse_args(argv)
    if not args.cache.is_dir():
        p.error(f"{args.cache} is not a directory")
    from bench.common import report  # torch's import: only once the arguments hold

    graphs = inventory(args.cache)
    if not graphs:
        p.error(f"no compiled graph's output code under {args.cache} (an inductor cache directory?)")
    for g in graphs:
        print(f"{g.kind} {g.path}:")
        for stem, n in g.stems().most_common(args.stems):
            print(f"  {n:3}  {stem}")
    rows = [{"kind": g.kind, "kernels": len(g.kernels), "output code": str(g.path)} for g in graphs]
    record = {"cache": str(args.cache), "graphs": [dict(row, names=list(g.kernels)) for row, g in zip(rows, graphs)]}
    report("compiled_graphs", record, f"compiled graphs in {args.cache}", rows, ["kind", "kernels", "output code"])


if __name__ == "__main__":
    main()
