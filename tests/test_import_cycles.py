"""No import cycle among the modules of dflash_core and service, as the source says them: every
import is an edge (those under `if TYPE_CHECKING:` and inside functions too, since hiding an
import there is how a cycle is usually kept out of sight), and so is each part the kinds table
names as "module:attribute", from the code that resolves it (the engine's run lookup imports
every kind's run module; decoding a job imports its job module).

CHECKED lists the packages whose modules must be in no cycle: all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("dflash_core", "service")
CHECKED = SCANNED


def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's __init__)."""
    found = {}
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(name, is_package, node.level, node.module)
                for alias in node.names:  # `from package import module` names the module
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in known else target)
        graph[name] = {e for e in edges if e in known and e != name}
    from dflash_core import kinds

    graph["dflash_core.kinds"] |= {k.job.partition(":")[0] for k in kinds.KINDS}
    graph["dflash_core.engine.kinds"] |= {k.run.partition(":")[0] for k in kinds.KINDS}
    return graph


def _absolute(name: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def checked(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in CHECKED)


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert "dflash_core.engine.engine" in graph and "dflash_core.train.run" in graph
    found = [c for c in cycles(graph) if any(checked(m) for m in c)]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
