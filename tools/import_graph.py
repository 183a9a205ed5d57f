"""Print the package import graph's back-edges and cycles.

    python tools/import_graph.py [ROOT]

Reads every module under the product packages (not tests/, bench/ or tools/) with
``ast``, including imports inside functions and under ``if TYPE_CHECKING`` (those
are listed apart: they do not run, but they still say which way a dependency goes).
The rule is by package (docs/architecture.md), with no list of exempt modules:

    core, tracing, auth            import nothing of Tandem
    proto                          core (proto/convert.py: proto <-> core values)
    engine                         core (no proto: the engine knows no networking)
    kvtransfer                     core, engine, proto, auth, tracing
    worker                         the above
    prefill_svc, decode_svc        the above and worker
    router                         core, proto, auth, tracing (no engine: no torch, no model)
    tandem                         anything; nothing imports tandem

A back-edge is an import a package may not make; a cycle is a loop of modules that
import each other, counting imports in functions and under TYPE_CHECKING too (a
loop hidden that way is still a loop in the design). Exit status 1 when there is
either.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

_BELOW_WORKER = {"core", "engine", "kvtransfer", "proto", "auth", "tracing"}
ALLOWED: dict[str, set[str]] = {
    "core": set(), "tracing": set(), "auth": set(),
    "proto": {"core"},
    "engine": {"core"},
    "kvtransfer": {"core", "engine", "proto", "auth", "tracing"},
    "worker": _BELOW_WORKER,
    "prefill_svc": _BELOW_WORKER | {"worker"},
    "decode_svc": _BELOW_WORKER | {"worker"},
    "router": {"core", "proto", "auth", "tracing"},
    "tandem": set(),  # anything: see allowed()
}
"""Each top-level package and the packages it may import (besides itself)."""


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in ALLOWED:
        for path in (root / pkg).rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, bool, bool]]:
    """(imported module, at module level, under TYPE_CHECKING) for each import."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool, bool]] = []

    def visit(node: ast.AST, top: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, top, True)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, False, typing_only)
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                targets = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.append((t, top, typing_only))
            visit(child, top, typing_only)
    visit(tree, True, False)
    return found


def allowed(src: str, dst: str) -> bool:
    a, b = src.split(".")[0], dst.split(".")[0]
    if a == b or a == "tandem":
        return True
    return b != "tandem" and b in ALLOWED[a]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    mods = modules(root)
    unruled = sorted(d.parent.name for d in root.glob("*/__init__.py")
                     if d.parent.name not in ALLOWED and d.parent.name not in ("tests", "bench", "tools"))
    known = set(mods)
    back, edges = set(), defaultdict(set)
    for name, path in sorted(mods.items()):
        for dst, top, typing_only in imports(path, name, known):
            edges[name].add(dst)
            if not allowed(name, dst):
                how = "TYPE_CHECKING" if typing_only else ("module" if top else "in a function")
                back.add(f"{name} -> {dst} ({how})")
    loops = cycles(edges)
    print(f"{len(mods)} modules; {len(back)} back-edges; {len(loops)} import cycles")
    for name in unruled:
        print(f"  package without a rule: {name} (add it to ALLOWED and docs/architecture.md)")
    for line in sorted(back):
        print("  back-edge:", line)
    for loop in loops:
        print("  cycle:", " <-> ".join(loop))
    return 1 if back or loops or unruled else 0


if __name__ == "__main__":
    sys.exit(main())
