"""The tree keeps its shape: imports run one way (tools/import_graph.py finds no
back-edge and no cycle), the router loads no torch and no model code, the core
package loads no torch, numpy or proto, no function outside bench/ is longer than 60
lines, and the engine knows nothing of who moves its KV."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def test_imports_run_one_way() -> None:
    r = _import_graph(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def _import_graph(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py"), str(root)],
                          capture_output=True, text=True, timeout=60)


def _run_python(code: str) -> str:
    """What a fresh interpreter in the checkout prints for code (stripped)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for pkg in ("core", "engine", "proto", "router", "tracing", "auth"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("rel, text, edge", [
    ("router/flow.py", "from engine.scheduler import Scheduler\n", "router.flow -> engine"),
    ("router/flow.py", "def f():\n    import engine.kv\n", "router.flow -> engine"),
    ("core/text.py", "import proto.convert\n", "core.text -> proto"),
    ("core/text.py", "from engine import llm\n", "core.text -> engine"),
    ("engine/runner.py", "from proto import common_pb2\n", "engine.runner -> proto"),
])
def test_the_import_rule_is_by_package(tmp_path: Path, rel: str, text: str, edge: str) -> None:
    """The rule names packages, not modules: a router module importing any engine
    module, or core importing proto or engine, is refused however small the import."""
    for f in ("engine/scheduler.py", "engine/kv.py", "engine/llm.py", "proto/convert.py",
              "proto/common_pb2.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    r = _import_graph(_tree(tmp_path, {rel: text}))
    assert r.returncode == 1 and f"back-edge: {edge}" in r.stdout, r.stdout
    assert _import_graph(_tree(tmp_path, {rel: ""})).returncode == 0


def test_a_package_without_a_rule_fails(tmp_path: Path) -> None:
    (tmp_path / "newpkg").mkdir()
    (tmp_path / "newpkg" / "__init__.py").write_text("")
    r = _import_graph(_tree(tmp_path, {}))
    assert r.returncode == 1 and "package without a rule: newpkg" in r.stdout, r.stdout


def test_core_loads_no_torch_numpy_or_proto() -> None:
    """Every core module imports, and none brings in torch, numpy, proto, grpc or
    another Tandem package (core/gguf_file.py reads a GGUF through numpy, loaded only
    when a tokenizer is read from a .gguf: it may bring numpy, never torch)."""
    probe = ("import sys, pkgutil, importlib, core\n"
             "for m in pkgutil.walk_packages(core.__path__, 'core.'):\n"
             "    if m.name != 'core.gguf_file': importlib.import_module(m.name)\n"
             "top = {m.split('.')[0] for m in sys.modules}\n"
             "bad = sorted(top & {'torch', 'numpy', 'proto', 'grpc', 'engine', 'router', "
             "'worker', 'kvtransfer', 'tracing', 'auth'})\n"
             "import core.gguf_file\n"
             "print(bad, 'torch' in sys.modules)")
    assert _run_python(probe) == "[] False", "core imported those"


def test_the_router_loads_no_torch_and_no_model_code() -> None:
    probe = ("import sys, router.app, router.state, router.http.routes, tandem.router_cli\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', "
             "'worker', 'kvtransfer', 'prefill_svc', 'decode_svc'))\n"
             "print(bad)")
    assert _run_python(probe) == "[]", "the router imported those"


def test_the_command_line_parses_without_torch() -> None:
    """`tandem --help` and every subcommand's flags build without torch (seconds to
    import), as does a worker's check of the secret file a user names: such errors
    come at once (tests/auth/test_cli_errors.py)."""
    probe = ("import sys, argparse\n"
             "from tandem.cli import build_parser\n"
             "from tandem.worker_cli import check_named_files\n"
             "build_parser()\n"
             "try:\n"
             "    check_named_files(argparse.Namespace(cluster_secret_file='/nonexistent'))\n"
             "except ValueError:\n"
             "    pass\n"
             "print('torch' in sys.modules)")
    assert _run_python(probe) == "False", "the command line imported torch"


def test_no_function_outside_bench_is_longer_than_60_lines() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "bench" or rel.parts[0].startswith(".venv") \
                or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # .venv-perf too
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


def test_the_package_metadata_uses_no_form_setuptools_retires() -> None:
    """Every `make` builds the package with the newest setuptools (pip's build isolation).
    `license = { text = ... }` warned "By 2027-Feb-18 ... your builds will no longer be
    supported": a fresh machine's `make test` would then stop at the install."""
    import warnings

    pytest.importorskip("setuptools", minversion="77",
                        reason="the build's own setuptools (pyproject: >= 77) reads SPDX licenses")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"


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
