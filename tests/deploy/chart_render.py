"""Render the Helm chart offline, without a helm binary.

helm-python-sdk binds Helm's own Go SDK (a shared library in its wheel) through ctypes,
so rendering, schema validation and lint are Helm's, not a reimplementation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tandem"
RELEASE = "tandem"
NAMESPACE = "llm"

# Value sets rendered by the tests: the defaults plus every chart-testing style file in ci/.
VALUE_SETS: dict[str, dict[str, Any]] = {"default": {}}
for _p in sorted((CHART / "ci").glob("*-values.yaml")):
    VALUE_SETS[_p.name.removesuffix("-values.yaml")] = yaml.safe_load(_p.read_text()) or {}


def render(chart, values: dict[str, Any], name: str = RELEASE,
           namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object, in template order (NOTES.txt left out)."""
    out = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path in sorted(out):
        if not path.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(out[path]) if d)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)
