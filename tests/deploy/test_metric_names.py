"""Every `tandem:*` metric name the deployment relies on (HPAs, prometheus-adapter rules,
docs, Grafana dashboard) is one the services really export.

The exported names come from a live source: the workers' and the router's metric classes,
instantiated, and their registries rendered with prometheus_client.generate_latest. A name
missing there fails the test with the list of missing names.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable

import pytest
import yaml

from tests.deploy.chart_render import CHART, ROOT, by_kind, render

DOCS = ROOT / "docs" / "deploy.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem-dashboard.json"
ADAPTER_VALUES = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"

# A metric name in PromQL / YAML / prose: "tandem:" then a Prometheus name tail.
METRIC = re.compile(r"tandem:[a-zA-Z_][a-zA-Z0-9_:]*")

HPA_METRICS = {
    "prefill": ["tandem:num_prompt_tokens_waiting"],
    "decode": ["tandem:kv_cache_usage_perc", "tandem:num_requests_running"],
}


def series_names(exposition: str) -> set[str]:
    """Series names in a Prometheus text exposition: the sample lines, plus what each
    `# TYPE` line implies (labelled metrics print no sample until a label set is used):
    a counter's name (with _total), a gauge's name, a histogram's _bucket/_sum/_count,
    a summary's _sum/_count and the name itself (quantiles)."""
    names: set[str] = set()
    suffixes = {"counter": [""], "gauge": [""], "untyped": [""], "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["", "_sum", "_count"], "info": ["_info", ""], "stateset": [""]}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update(name + s for s in suffixes.get(kind.strip(), [""]))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def exported_metric_names() -> set[str]:
    """Live: the names the worker and router metric classes export."""
    from prometheus_client import generate_latest

    from router.metrics import RouterMetrics
    from worker.metrics import WorkerMetrics

    names: set[str] = set()
    registries = [WorkerMetrics("prefill", "prefill-0").registry,
                  WorkerMetrics("decode", "decode-0").registry,
                  RouterMetrics().registry]
    for registry in registries:
        names |= series_names(generate_latest(registry).decode())
    names = {n for n in names if n.startswith("tandem:")}
    assert len(names) > 20, names
    return names


# -- the names the deployment uses -----------------------------------------------------------------

def _yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", markdown, flags=re.S)


def adapter_rules_in_docs() -> list[dict[str, Any]]:
    rules = []
    for block in _yaml_blocks(DOCS.read_text()):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and "rules" in doc:
            rules.extend(doc["rules"]["custom"])
    return rules


def adapter_rules_in_values() -> list[dict[str, Any]]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        queries.extend(_strings(q) if isinstance(q, dict) else [q] if var["type"] == "query" else [])
    return queries


def hpa_metric_names(chart_docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {hpa["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1]:
            [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
            for hpa in by_kind(chart_docs, "HorizontalPodAutoscaler").values()}


@pytest.fixture(scope="module")
def autoscaled_chart() -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart (dev extra)")
    with helm.Chart.load(CHART) as chart:
        return render(chart, {"prefill": {"autoscaling": {"enabled": True}},
                              "decode": {"autoscaling": {"enabled": True}}})


def used_metric_names(chart_docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Where each used name comes from -> the names (a reusable list for other checks,
    e.g. against a running `tandem up`)."""
    hpas = {n for names in hpa_metric_names(chart_docs).values() for n in names}
    return {
        "chart HPAs": hpas,
        "adapter rules (docs/deploy.md)": {n for s in _strings(adapter_rules_in_docs()) for n in METRIC.findall(s)},
        "adapter rules (deploy/prometheus-adapter/values.yaml)":
            {n for s in _strings(adapter_rules_in_values()) for n in METRIC.findall(s)},
        "docs/deploy.md": set(METRIC.findall(DOCS.read_text())),
        "grafana dashboard": {n for q in dashboard_queries() for n in METRIC.findall(q)},
    }


# -- checks ------------------------------------------------------------------------------------

def test_series_names_parser():
    text = ("# HELP tandem:a_total x\n# TYPE tandem:a_total counter\n"
            "# TYPE tandem:h histogram\n# TYPE tandem:g gauge\ntandem:g{role=\"x\"} 1.0\n")
    assert series_names(text) == {"tandem:a_total", "tandem:h_bucket", "tandem:h_sum", "tandem:h_count",
                                  "tandem:g"}


def test_every_used_metric_name_is_exported(exported_metric_names, autoscaled_chart):
    used = used_metric_names(autoscaled_chart)
    for source, names in used.items():
        assert names, f"found no tandem:* names in {source}"
    missing = {source: sorted(names - exported_metric_names) for source, names in used.items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, ("metric names used by the deployment but not exported by "
                         f"worker.metrics.WorkerMetrics / router.metrics.RouterMetrics: {missing}")


def test_hpas_use_the_agreed_metrics(autoscaled_chart):
    assert hpa_metric_names(autoscaled_chart) == HPA_METRICS


def test_adapter_serves_every_hpa_metric():
    """Each HPA metric has a prometheus-adapter rule that exposes it under the same name,
    per pod; the rules in the docs are the ones in deploy/prometheus-adapter/values.yaml."""
    docs_rules, file_rules = adapter_rules_in_docs(), adapter_rules_in_values()
    assert docs_rules == file_rules
    assert yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["default"] is False
    served = {}
    for rule in file_rules:
        (series,) = METRIC.findall(rule["seriesQuery"])
        as_name = rule["name"]["as"]
        assert re.fullmatch(rule["name"]["matches"], series), rule
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
        assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
        served[as_name] = series
    for names in HPA_METRICS.values():
        for name in names:
            assert served.get(name) == name, f"no adapter rule serves {name}"


def test_dashboard_covers_the_brief():
    dash = json.loads(DASHBOARD.read_text())
    queries = " ".join(dashboard_queries())
    for name in ["tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                 "tandem:e2e_request_latency_seconds_bucket", "tandem:router_requests_total",
                 "tandem:router_prompt_tokens_total", "tandem:router_generation_tokens_total",
                 "tandem:kv_cache_usage_perc", "tandem:prefix_cache_hits_predicted_total",
                 "tandem:prefix_cache_hits_realized_total", "tandem:kv_transfer_bytes_total",
                 "tandem:kv_transfer_seconds_bucket", "tandem:kv_transfer_fallbacks_total",
                 "tandem:num_preemptions_total", "tandem:kv_leases_active",
                 "tandem:router_healthy_workers"]:
        assert name in queries, name
    assert "sum by (path" in queries  # request rates by path
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
