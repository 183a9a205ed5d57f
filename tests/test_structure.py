"""The tree keeps its shape: imports run one way (tools/import_graph.py finds no
back-edge and no cycle), the router loads no torch and no model code, and no
function outside bench/ is longer than 60 lines, and the engine knows nothing of
who moves its KV."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def test_imports_run_one_way() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py"), str(ROOT)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_router_loads_no_torch_and_no_model_code() -> None:
    probe = ("import sys, router.app, router.state, router.http.routes, tandem.router_cli\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', "
             "'kvtransfer', 'prefill_svc', 'decode_svc') or m.startswith(("
             "'engine.models', 'engine.attention', 'engine.model_runner', 'engine.scheduler', "
             "'engine.llm_engine', 'engine.loader', 'engine.sampling.sampler')))\n"
             "print(bad)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"the router imported: {r.stdout.strip()}"


def test_no_function_outside_bench_is_longer_than_60_lines() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("bench", ".venv") or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_every_package_is_installed() -> None:
    """A top-level package missing from pyproject's package list works from a checkout
    (the current directory is on sys.path) but not from the installed `tandem` command:
    `auth/` was left out, and `.venv/bin/tandem up` died with "No module named 'auth'"."""
    import fnmatch
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py")
                      if p.parent.name not in ("tests", "tools", "bench"))
    missing = [p for p in packages if not any(fnmatch.fnmatch(p, pat) for pat in include)]
    assert missing == [], f"packages missing from pyproject.toml's include: {missing}"


HANDOFF_WORDS = re.compile(r"\b(leases?|handoffs?|remote|held|reserv\w*|grant\w*|pull\w*|"
                           r"prefill_only|prefill workers?|decode workers?)\b", re.IGNORECASE)


def test_the_engine_and_its_scheduler_know_no_handoff() -> None:
    """LLMEngine and the Scheduler talk to a KV connector (engine/kv_connector.py) and
    know nothing of the prefill/decode handoff that the services plug in (kvtransfer/
    prefill_connector.py, decode_connector.py): none of its words is in their source."""
    found = []
    for rel in ("engine/llm_engine.py", "engine/scheduler.py"):
        for i, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
            if HANDOFF_WORDS.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
