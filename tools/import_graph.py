"""Print the package import graph's back-edges and cycles.

    python tools/import_graph.py [ROOT]

Reads every module under the product packages (not tests/, bench/ or tools/) with
``ast``, including imports inside functions and under ``if TYPE_CHECKING`` (those
are listed apart: they do not run, but they still say which way a dependency goes).
The layering it checks (docs/architecture.md):

    proto, tracing  <-  engine  <-  kvtransfer  <-  worker  <-  prefill_svc, decode_svc
    tracing (OpenTelemetry spans) imports nothing of Tandem
    router may import proto, tracing, engine's torch-free modules (TORCH_FREE) and itself
    tandem may import anything; nothing imports tandem

A back-edge is an import a layer may not make; a cycle is a loop of modules that
import each other, counting imports in functions and under TYPE_CHECKING too (a
loop hidden that way is still a loop in the design). Exit status 1 when there is
either.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

LAYERS = {"proto": 0, "tracing": 0, "engine": 1, "kvtransfer": 2, "worker": 3, "prefill_svc": 4,
          "decode_svc": 4, "router": 4, "tandem": 5}
TORCH_FREE = {"engine", "engine.kv_cache", "engine.kv_cache.block_hash",
              "engine.kv_cache.block_pool", "engine.kv_cache.manager", "engine.kv_cache.layout",
              "engine.tokenizer", "engine.chat_template", "engine.limits", "engine.sampling",
              "engine.sampling.params", "engine.sampling.stop", "engine.text", "engine.wire",
              "engine.registry", "engine.guided", "engine.guided.spec",
              "engine.guided.compiler", "engine.guided.search", "engine.errors",
              "engine.states"}
"""The engine modules the router may import: they load no torch and no model code."""


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
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
    if a == b:
        return True
    if b == "tandem":
        return False
    if a == "tandem":
        return True
    if a == "router":
        return b in ("proto", "tracing") or dst in TORCH_FREE
    return LAYERS[b] < LAYERS[a] and not (b == "router")


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
    for line in sorted(back):
        print("  back-edge:", line)
    for loop in loops:
        print("  cycle:", " <-> ".join(loop))
    return 1 if back or loops else 0


if __name__ == "__main__":
    sys.exit(main())
