"""The Helm chart, rendered offline (helm-python-sdk: Helm's Go engine, no helm binary):
lint, Kubernetes schema validation (kubernetes-validate --strict), the wiring between
objects, and values.schema.json (closed, complete, rejects bad values)."""
from __future__ import annotations

import base64
import functools
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart_render import (CHART, NAMESPACE, RELEASE, VALUE_SETS, by_kind, container,
                                       one, render)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart (dev extra)")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra)")
jsonschema = pytest.importorskip("jsonschema")

KUBE_VERSIONS = ("1.30.0", kv.latest_version())
FULL = RELEASE  # release "tandem" + chart "tandem" -> names are "tandem-<component>"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict[str, Any]]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


# -- every value set: lint, Kubernetes validation ------------------------------------------------

def test_value_sets_cover_the_brief():
    assert {"default", "gpu", "autoscaling", "edge", "existing", "tensor-parallel"} <= set(VALUE_SETS)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_is_clean(name):
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE,
                       kube_version="v1.30.0")
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.fixture(scope="module")
def cached_kubernetes_validate():
    """kubernetes-validate re-reads its 1.2 MB definitions file on every call; cache the
    file reads for this module (same results, a few times faster)."""
    from kubernetes_validate import utils
    original = utils.schema_contents
    utils.schema_contents = functools.lru_cache(maxsize=None)(original)
    try:
        yield kv
    finally:
        utils.schema_contents = original


# kubernetes-validate knows only built-in kinds. The CRD kinds the chart can emit are checked
# against these closed schemas of exactly the fields the chart writes (names and types as in
# monitoring.coreos.com/v1 and gateway.networking.k8s.io/v1), so a typo still fails.
_STR = {"type": "string"}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"], "additionalProperties": False,
         "properties": {"name": _STR, "labels": _STRMAP, "annotations": _STRMAP}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {"matchLabels": _STRMAP}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False,
                "properties": {"matchNames": {"type": "array", "items": _STR}, "any": {"type": "boolean"}}}
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["key"],
               "properties": {"name": _STR, "key": _STR, "optional": {"type": "boolean"}}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"port": _STR, "path": _STR, "interval": _DURATION, "scrapeTimeout": _DURATION,
                            "bearerTokenSecret": _SECRET_KEY}}


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                           "metadata": _META, "spec": spec}}


CRD_SCHEMAS = {
    "ServiceMonitor": _crd("monitoring.coreos.com/v1", "ServiceMonitor", {
        "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
        "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                       "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    "PodMonitor": _crd("monitoring.coreos.com/v1", "PodMonitor", {
        "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
        "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    "HTTPRoute": _crd("gateway.networking.k8s.io/v1", "HTTPRoute", {
        "type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
        "properties": {
            "parentRefs": {"type": "array", "minItems": 1, "maxItems": 32, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"group": _STR, "kind": _STR, "name": {"type": "string", "minLength": 1},
                               "namespace": _STR, "sectionName": _STR,
                               "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
            "hostnames": {"type": "array", "items": _STR},
            "rules": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "matches": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "path": {"type": "object", "additionalProperties": False,
                                     "required": ["type", "value"],
                                     "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                    "value": {"type": "string", "pattern": "^/"}}}}}},
                    "backendRefs": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["name", "port"],
                        "properties": {"name": _STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
                    "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                        "request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"},
                        "backendRequest": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}}}}}}}),
}


LWS_SCHEMA_PATH = Path(__file__).parent / "schemas" / "leaderworkerset-v1.yaml"
"""The LeaderWorkerSet CRD's published openAPIV3Schema (its header names the source)."""


def _closed(node: Any) -> Any:
    """A CRD's structural schema as the API server's strict field validation reads it:
    an object with declared properties takes no other field (unless it says it keeps
    unknown fields)."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def lws_schema() -> dict[str, Any]:
    schema = _closed(yaml.safe_load(LWS_SCHEMA_PATH.read_text()))
    schema["properties"]["apiVersion"] = {"const": "leaderworkerset.x-k8s.io/v1"}
    schema["properties"]["kind"] = {"const": "LeaderWorkerSet"}
    schema["properties"]["metadata"] = _META
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def lws_pod_templates(lws: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """leader / worker -> the pod template of a LeaderWorkerSet."""
    t = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def _validate_lws(doc: dict[str, Any], kube, where: str) -> list[str]:
    """The published CRD schema, and each pod template as the Kubernetes PodTemplate
    it becomes (kubernetes-validate --strict: the built-in types in full)."""
    errors = []
    try:
        jsonschema.validate(doc, lws_schema())
    except jsonschema.ValidationError as e:
        errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
    for role, template in lws_pod_templates(doc).items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{doc['metadata']['name']}-{role}"}, "template": template}
        for version in KUBE_VERSIONS:
            try:
                kube.validate(wrapped, version, strict=True)
            except kv.ValidationError as e:
                errors.append(f"{where} {role} template (k8s {version}): "
                              f"{'.'.join(map(str, e.path))}: {e.message}")
    return errors


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_manifest_validates_strict(name, rendered, cached_kubernetes_validate):
    errors = []
    for doc in rendered[name]:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "LeaderWorkerSet":
            errors += _validate_lws(doc, cached_kubernetes_validate, where)
            continue
        if doc["kind"] in CRD_SCHEMAS:
            try:
                jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
            except jsonschema.ValidationError as e:
                errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
            continue
        for version in KUBE_VERSIONS:
            try:
                cached_kubernetes_validate.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                errors.append(f"{where} (k8s {version}): {'.'.join(map(str, e.path))}: {e.message}")
            except kv.SchemaNotFoundError:
                errors.append(f"{where}: no Kubernetes {version} schema for {doc['apiVersion']}")
        assert doc["metadata"].get("namespace") in (None, NAMESPACE)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_names_are_unique_per_kind(name, rendered):
    seen = [(d["kind"], d["metadata"]["name"]) for d in rendered[name]]
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_env_references_in_args_resolve(name, rendered):
    """Every $(VAR) in a container's command/args is defined by its env or envFrom ConfigMap
    (Kubernetes leaves unknown references as literal text)."""
    docs = rendered[name]
    configmaps = by_kind(docs, "ConfigMap")
    pods = [(dep["metadata"]["name"], dep["spec"]["template"]["spec"], set())
            for dep in by_kind(docs, "Deployment").values()]
    for lws in by_kind(docs, "LeaderWorkerSet").values():  # LWS sets these in every container
        pods += [(f"{lws['metadata']['name']}/{role}", t["spec"], set(LWS_ENV))
                 for role, t in lws_pod_templates(lws).items()]
    for owner, spec, injected in pods:
        for c in spec["containers"] + spec.get("initContainers", []):
            defined = {e["name"] for e in c.get("env", [])} | injected
            for src in c.get("envFrom", []):
                defined |= set(configmaps[src["configMapRef"]["name"]]["data"])
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in defined, f"{owner}/{c['name']}: $({ref}) in {arg!r}"


LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
"""What the LWS controller adds to every container of a group (lws api/leaderworkerset/v1)."""


# -- default values: what is there and how it is wired -------------------------------------------

def test_default_objects(rendered):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered["default"])
    assert kinds == sorted([
        ("ConfigMap", f"{FULL}-config"),
        ("Deployment", f"{FULL}-router"), ("Deployment", f"{FULL}-prefill"), ("Deployment", f"{FULL}-decode"),
        ("Service", f"{FULL}-router"), ("Service", f"{FULL}-prefill"), ("Service", f"{FULL}-decode"),
        ("ServiceAccount", f"{FULL}-router"), ("Role", f"{FULL}-router"), ("RoleBinding", f"{FULL}-router"),
        ("PodDisruptionBudget", f"{FULL}-router"), ("PodDisruptionBudget", f"{FULL}-prefill"),
        ("PodDisruptionBudget", f"{FULL}-decode"),
        ("NetworkPolicy", f"{FULL}-router"), ("NetworkPolicy", f"{FULL}-workers"),
        ("Secret", f"{FULL}-cluster"),
    ])


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",")))


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} appears {len(values)} times in {args}"
    return values[0]


def test_router_discovers_exactly_its_own_worker_services(chart, rendered):
    """The router's label selectors match this release's prefill/decode Services (whose labels
    EndpointSlices inherit) and nothing else, not even another release's."""
    docs = rendered["default"] + render(chart, {}, name="other")
    services = by_kind(docs, "Service")
    args = container(one(rendered["default"], "Deployment", f"{FULL}-router"))["args"]
    assert "--discovery=kubernetes" in args and "--k8s-port-name=grpc" in args
    assert _flag(args, "k8s-namespace") == "$(POD_NAMESPACE)"
    for role in ("prefill", "decode"):
        selector = _flag(args, f"k8s-{role}-selector")
        matched = [n for n, s in services.items() if _selector_matches(selector, s["metadata"]["labels"])]
        assert matched == [f"{FULL}-{role}"], (role, matched)
        svc = services[f"{FULL}-{role}"]
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert svc["spec"]["clusterIP"] == "None"
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert ports["grpc"]["port"] == 9000 and ports["grpc"]["targetPort"] == "grpc"
        # the Service selects the pool's pods
        pod_labels = one(rendered["default"], "Deployment", f"{FULL}-{role}")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_router_rbac_watches_endpointslices(rendered):
    docs = rendered["default"]
    role = one(docs, "Role", f"{FULL}-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", f"{FULL}-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{FULL}-router"}
    sa = one(docs, "ServiceAccount", f"{FULL}-router")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    router = one(docs, "Deployment", f"{FULL}-router")["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == sa
    for role_name in ("prefill", "decode"):
        assert one(docs, "Deployment", f"{FULL}-{role_name}")["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is False


def test_router_pod(rendered):
    docs = rendered["default"]
    dep = one(docs, "Deployment", f"{FULL}-router")
    c = container(dep)
    assert c["command"] == ["tandem"] and c["args"][1] == "router"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    assert _flag(c["args"], "port") == "8000" and _flag(c["args"], "host") == "0.0.0.0"
    assert _flag(c["args"], "metrics-port") == "9100"  # /metrics leaves the API port
    assert not any(a.startswith("--metrics-key-file") for a in c["args"])
    assert _flag(c["args"], "block-size") == "$(TANDEM_BLOCK_SIZE)"
    assert _flag(c["args"], "model") == "$(TANDEM_MODEL)"
    assert not any(e["name"] == "TANDEM_API_KEY" for e in c["env"])
    _assert_cluster_secret(dep)
    svc = one(docs, "Service", f"{FULL}-router")
    assert svc["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http", 8000, "http"), ("metrics", 9100, "metrics")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_pod(rendered, role):
    docs = rendered["default"]
    dep = one(docs, "Deployment", f"{FULL}-{role}")
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    args = c["args"]
    assert args[:2] == ["--log-level=$(TANDEM_LOG_LEVEL)", role]
    # bind and advertise an address other pods can dial (it goes into KV handles)
    assert _flag(args, "host") == "$(POD_IP)" and _flag(args, "port") == "9000"
    assert _flag(args, "metrics-port") == "9100" and _flag(args, "worker-id") == "$(POD_NAME)"
    assert _flag(args, "kv-transfer") == "$(TANDEM_KV_TRANSFER)"
    # both pools take the KV dtype from one value: a P/D mismatch is refused at connect
    assert _flag(args, "kv-cache-dtype") == "$(TANDEM_KV_CACHE_DTYPE)"
    assert not any(a.startswith("--device") for a in args)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 9000}, probe
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 9000, "metrics": 9100}
    # graceful termination: endpoints drain during the preStop sleep, then SIGTERM
    assert pod["terminationGracePeriodSeconds"] == 60
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    # model delivery: init container fetches into the shared volume, the worker mounts it read-only
    init = pod["initContainers"]
    assert [i["name"] for i in init] == ["fetch-model"]
    assert init[0]["command"] == ["flock", "/models/.fetch-model.lock", "tandem"]
    assert init[0]["args"][:3] == ["fetch-model", "--cache-dir", "/models"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "models", "emptyDir": {"sizeLimit": "2Gi"}} in pod["volumes"]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    _assert_cluster_secret(dep)


def _assert_cluster_secret(dep) -> None:
    """Every service pod mounts the cluster secret read-only and is told where it is."""
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert _flag(c["args"], "cluster-secret-file") == "/etc/tandem/cluster/cluster-secret"
    assert {"name": "cluster-secret", "mountPath": "/etc/tandem/cluster",
            "readOnly": True} in c["volumeMounts"]
    assert {"name": "cluster-secret", "secret": {"secretName": f"{FULL}-cluster",
                                                 "defaultMode": 0o400}} in pod["volumes"]


def test_cluster_secret_is_random_and_can_be_brought(chart):
    a, b = (one(render(chart, {}), "Secret", f"{FULL}-cluster") for _ in range(2))
    assert a["data"]["cluster-secret"] != b["data"]["cluster-secret"]
    assert len(base64.b64decode(a["data"]["cluster-secret"])) == 64
    docs = render(chart, {"clusterSecret": {"existingSecret": "mine"}})
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-cluster")]
    dep = one(docs, "Deployment", f"{FULL}-decode")
    assert {"name": "cluster-secret", "secret": {"secretName": "mine", "defaultMode": 0o400}} \
        in dep["spec"]["template"]["spec"]["volumes"]


def test_api_keys_file_from_a_secret(chart):
    dep = one(render(chart, {"auth": {"keysSecret": "team-keys"}}), "Deployment", f"{FULL}-router")
    c = container(dep)
    assert _flag(c["args"], "api-keys-file") == "/etc/tandem/keys/keys.yaml"
    assert {"name": "api-keys", "secret": {"secretName": "team-keys", "defaultMode": 0o400}} \
        in dep["spec"]["template"]["spec"]["volumes"]


def test_configmap_holds_the_shared_settings(rendered):
    data = one(rendered["default"], "ConfigMap", f"{FULL}-config")["data"]
    assert data["TANDEM_MODEL"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert data["TANDEM_BLOCK_SIZE"] == "16" and data["TANDEM_HASH_SEED"] == "0"
    assert data["TANDEM_KV_TRANSFER"] == "nixl"
    assert data["TANDEM_KV_CACHE_DTYPE"] == "auto"
    for dep in by_kind(rendered["default"], "Deployment").values():
        assert container(dep)["envFrom"] == [{"configMapRef": {"name": f"{FULL}-config"}}]


def test_large_integers_render_as_integers(chart):
    """Helm keeps numbers as float64 and would print 2000000 as 2e+06, which argparse refuses."""
    docs = render(chart, {"decode": {"kvBlocks": 2000000, "maxNumBatchedTokens": 1048576},
                          "config": {"hashSeed": 123456789012}})
    args = container(one(docs, "Deployment", f"{FULL}-decode"))["args"]
    assert _flag(args, "kv-blocks") == "2000000" and _flag(args, "max-num-batched-tokens") == "1048576"
    assert one(docs, "ConfigMap", f"{FULL}-config")["data"]["TANDEM_HASH_SEED"] == "123456789012"


def test_config_change_rolls_every_deployment(chart, rendered):
    changed = render(chart, {"config": {"blockSize": 32}})
    for name, dep in by_kind(rendered["default"], "Deployment").items():
        before = dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        after = one(changed, "Deployment", name)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        assert before != after, name


def test_default_network_policies(rendered):
    docs = rendered["default"]
    router_np = one(docs, "NetworkPolicy", f"{FULL}-router")
    assert router_np["spec"]["ingress"] == [  # anyone on the API port, scrapers on metrics
        {"ports": [{"port": "http", "protocol": "TCP"}]},
        {"from": [{"namespaceSelector": {}, "podSelector": {}}],
         "ports": [{"port": "metrics", "protocol": "TCP"}]}]
    workers = one(docs, "NetworkPolicy", f"{FULL}-workers")["spec"]
    assert workers["policyTypes"] == ["Ingress"]
    grpc_rule, transfer_rule, metrics_rule = workers["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in grpc_rule["from"]] == ["router"]
    # worker <-> worker: every port (UCX and the TCP fallback pick theirs at run time)
    assert "ports" not in transfer_rule
    peer = transfer_rule["from"][0]["podSelector"]
    assert peer["matchExpressions"] == workers["podSelector"]["matchExpressions"]
    assert peer["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert metrics_rule == {"from": [{"namespaceSelector": {}, "podSelector": {}}],
                            "ports": [{"port": "metrics", "protocol": "TCP"}]}


def test_pdbs(rendered):
    for name, pdb in by_kind(rendered["default"], "PodDisruptionBudget").items():
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"], name
    budgets = {n: p["spec"] for n, p in by_kind(rendered["autoscaling"], "PodDisruptionBudget").items()}
    assert budgets[f"{FULL}-decode"]["minAvailable"] == "50%" and "maxUnavailable" not in budgets[f"{FULL}-decode"]
    assert budgets[f"{FULL}-router"]["minAvailable"] == 1
    assert f"{FULL}-decode" not in by_kind(rendered["existing"], "PodDisruptionBudget")


WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def test_a_leaderworkerset_pools_budgets_count_groups(chart, rendered):
    """Decode at TP 4 over 2-GPU nodes (groups of 2 pods): the pool's budget selects the
    leaders only (one per group, down whenever its group is), so maxUnavailable 1 is one
    group; a second budget holds the worker pods to a group's worth (a worker's eviction
    recreates its group). Prefill's Deployment at TP 2: one budget, every pod, as before."""
    docs = rendered["tensor-parallel"]
    budgets = by_kind(docs, "PodDisruptionBudget")
    leaders, workers = budgets[f"{FULL}-decode"]["spec"], budgets[f"{FULL}-decode-workers"]["spec"]
    pod_labels = lws_pod_templates(one(docs, "LeaderWorkerSet", f"{FULL}-decode"))["leader"][
        "metadata"]["labels"]
    assert leaders["maxUnavailable"] == 1
    assert leaders["selector"] == {"matchLabels": {**{k: pod_labels[k] for k in (
        "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")},
        WORKER_INDEX: "0"}}
    assert workers["maxUnavailable"] == 1  # one worker pod per group of 2
    assert workers["selector"]["matchLabels"] == {
        k: v for k, v in leaders["selector"]["matchLabels"].items() if k != WORKER_INDEX}
    assert workers["selector"]["matchExpressions"] == [
        {"key": WORKER_INDEX, "operator": "NotIn", "values": ["0"]}]
    prefill = budgets[f"{FULL}-prefill"]["spec"]
    assert WORKER_INDEX not in prefill["selector"]["matchLabels"]
    assert "matchExpressions" not in prefill["selector"]
    assert set(budgets) == {f"{FULL}-router", f"{FULL}-prefill", f"{FULL}-decode",
                            f"{FULL}-decode-workers"}
    # groups of 4 single-GPU pods: the workers' budget is 3 pods per group
    values = {**VALUE_SETS["tensor-parallel"], "decode": {
        **VALUE_SETS["tensor-parallel"]["decode"], "gpusPerNode": 1,
        "pdb": {"enabled": True, "minAvailable": 1}}}
    budgets = by_kind(render(chart, values), "PodDisruptionBudget")
    assert budgets[f"{FULL}-decode"]["spec"]["minAvailable"] == 1
    assert budgets[f"{FULL}-decode-workers"]["spec"]["minAvailable"] == 3
    values["decode"]["pdb"] = {"enabled": True, "minAvailable": None, "maxUnavailable": "50%"}
    budgets = by_kind(render(chart, values), "PodDisruptionBudget")
    assert [budgets[f"{FULL}-decode{s}"]["spec"]["maxUnavailable"] for s in ("", "-workers")] == [
        "50%", "50%"]


# -- non-default sets ---------------------------------------------------------------------------

def test_gpu_pools(rendered):
    docs = rendered["gpu"]
    expected = {"prefill": ("prefill-h100", 1), "decode": ("decode-l40s", 2)}
    for role, (pool, gpus) in expected.items():
        dep = one(docs, "Deployment", f"{FULL}-{role}")
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        assert "--device=cuda" in c["args"]
        assert c["image"] == "registry.example.com/tandem:0.1.0-cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["nodeSelector"] == {"tandem.dev/pool": pool}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert dep["spec"]["replicas"] == {"prefill": 2, "decode": 4}[role]
    prefill = container(one(docs, "Deployment", f"{FULL}-prefill"))
    assert prefill["resources"]["limits"]["memory"] == "64Gi"  # user limits kept next to the GPU
    assert _flag(prefill["args"], "kv-cache-memory-gib") == "20"
    assert _flag(prefill["args"], "lease-ttl-s") == "15"
    assert {"name": "rdma", "mountPath": "/dev/infiniband"} in prefill["volumeMounts"]
    decode_dep = one(docs, "Deployment", f"{FULL}-decode")
    decode = container(decode_dep)
    assert _flag(decode["args"], "kv-blocks") == "200000"
    assert _flag(decode["args"], "transfer-timeout-s") == "5"
    assert decode_dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert decode["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    # the router and the init containers stay on the CPU image
    router = container(one(docs, "Deployment", f"{FULL}-router"))
    assert router["image"] == "registry.example.com/tandem:0.1.0"
    assert one(docs, "ConfigMap", f"{FULL}-config")["data"]["UCX_TLS"] == "rc,cuda_copy,tcp"


def test_tensor_parallel_pools(rendered):
    """Prefill at TP 2 fits one node: today's Deployment, 2 GPUs per pod, the flag passed.
    Decode at TP 4 over 2-GPU nodes: a LeaderWorkerSet of groups of 2 pods; the leader
    serves gRPC as rank 0 (ranks 0-1), the worker pod runs ranks 2-3, both meet at the
    leader's address from LWS's env; only leaders are behind the decode Service."""
    docs = rendered["tensor-parallel"]
    prefill = container(one(docs, "Deployment", f"{FULL}-prefill"))
    assert _flag(prefill["args"], "tensor-parallel-size") == "2"
    assert not any(a.startswith("--tp-") for a in prefill["args"])
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert f"{FULL}-decode" not in by_kind(docs, "Deployment")
    lws = one(docs, "LeaderWorkerSet", f"{FULL}-decode")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = lws_pod_templates(lws)
    leader, worker = (container({"spec": {"template": t}}) for t in pods.values())
    assert leader["args"][:2] == ["--log-level=$(TANDEM_LOG_LEVEL)", "decode"]
    rendezvous = "$(LWS_LEADER_ADDRESS):29500"
    assert [_flag(leader["args"], f) for f in ("tensor-parallel-size", "tp-rendezvous",
                                               "tp-ranks-per-node", "tp-join-timeout-s")] == [
        "4", rendezvous, "2", "600"]
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {
        "tp-rendezvous": 29500, "grpc": 9000, "metrics": 9100}
    assert leader["readinessProbe"]["grpc"] == {"port": 9000}
    assert worker["args"] == ["--log-level=$(TANDEM_LOG_LEVEL)", "tp-follower",
                              f"--tp-rendezvous={rendezvous}", "--tensor-parallel-size=4",
                              "--tp-node-index=$(LWS_WORKER_INDEX)", "--tp-ranks-per-node=2",
                              "--tp-join-timeout-s=600", "--device=cuda"]
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert c["image"] == "registry.example.com/tandem:0.1.0-cuda"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    for t in pods.values():  # every rank loads the checkpoint: every pod fetches it
        assert [i["name"] for i in t["spec"]["initContainers"]] == ["fetch-model"]
        assert t["spec"]["nodeSelector"] == {"tandem.dev/pool": "decode-2gpu"}
        assert t["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    selector = one(docs, "Service", f"{FULL}-decode")["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in (
        one(docs, "Service", f"{FULL}-prefill")["spec"]["selector"])


def test_a_tensor_parallel_pool_takes_either_kv_transfer(chart):
    """A group's KV moves over nixl (the default) as over tcp (docs/tensor-parallel.md)."""
    for kv in ("nixl", "tcp"):
        docs = render(chart, {"config": {"kvTransfer": kv}, "decode": {"tensorParallelSize": 2}})
        assert _flag(container(one(docs, "Deployment", f"{FULL}-decode"))["args"],
                     "tensor-parallel-size") == "2"
        assert one(docs, "ConfigMap", f"{FULL}-config")["data"]["TANDEM_KV_TRANSFER"] == kv


def test_default_pools_pass_no_tensor_parallel_flags(rendered):
    for name in ("default", "gpu"):
        for dep in by_kind(rendered[name], "Deployment").values():
            assert not any(a.startswith(("--tensor-parallel", "--tp-"))
                           for a in container(dep).get("args", [])), dep["metadata"]["name"]
        assert not by_kind(rendered[name], "LeaderWorkerSet")


def test_group_ports_are_open_under_a_strict_network_policy(chart):
    values = {**VALUE_SETS["tensor-parallel"],
              "networkPolicy": {"workerTransfer": {"ports": [{"port": 20000, "endPort": 20999}]}}}
    policy = one(render(chart, values), "NetworkPolicy", f"{FULL}-workers")
    groups = [r for r in policy["spec"]["ingress"]
              if any(e.get("key") == "leaderworkerset.sigs.k8s.io/name"
                     for f in r.get("from", []) for e in f.get("podSelector", {}).get("matchExpressions", []))]
    assert len(groups) == 1 and "ports" not in groups[0]


def test_autoscaling_and_service_monitor(rendered):
    docs = rendered["autoscaling"]
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{FULL}-prefill", f"{FULL}-decode"}
    for role, hpa in ((r, hpas[f"{FULL}-{r}"]) for r in ("prefill", "decode")):
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-{role}"}
        assert "replicas" not in one(docs, "Deployment", f"{FULL}-{role}")["spec"]
    metrics = {r: [(m["pods"]["metric"]["name"], m["pods"]["target"]) for m in hpas[f"{FULL}-{r}"]["spec"]["metrics"]]
               for r in ("prefill", "decode")}
    assert metrics["prefill"] == [("tandem:num_prompt_tokens_waiting", {"type": "AverageValue", "averageValue": "4096"})]
    assert metrics["decode"] == [
        ("tandem:kv_cache_usage_perc", {"type": "AverageValue", "averageValue": "750m"}),
        ("tandem:num_requests_running", {"type": "AverageValue", "averageValue": "48"})]
    assert hpas[f"{FULL}-prefill"]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # the ServiceMonitor scrapes ports that exist on the Services it selects
    sm = one(docs, "ServiceMonitor", FULL)
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [s for s in by_kind(docs, "Service").values()
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 3
    assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in selected)
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert not by_kind(docs, "PodMonitor")


SCRAPERS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_router_from_admits_only_its_peers_on_the_api_port(chart, rendered):
    """With networkPolicy.router.from set, the API port admits those peers and nobody
    else: the scrapers' peer (whose selectors default to {}, every pod of every
    namespace) used to be appended to it. Scrapers get the metrics port, alone."""
    gateway = {"podSelector": {"matchLabels": {"app": "gateway"}}}
    docs = render(chart, {"networkPolicy": {"router": {"from": [gateway]}}})  # scrapers: {}
    rules = one(docs, "NetworkPolicy", f"{FULL}-router")["spec"]["ingress"]
    assert [r["from"] for r in rules if {"port": "http", "protocol": "TCP"} in r["ports"]] \
        == [[gateway]]
    rules = one(rendered["autoscaling"], "NetworkPolicy", f"{FULL}-router")["spec"]["ingress"]
    (api_rule,) = [r for r in rules if {"port": "http", "protocol": "TCP"} in r["ports"]]
    assert SCRAPERS not in api_rule["from"]
    assert api_rule == {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
        "ports": [{"port": "http", "protocol": "TCP"}]}
    (metrics_rule,) = [r for r in rules if {"port": "metrics", "protocol": "TCP"} in r["ports"]]
    assert metrics_rule == {"from": [SCRAPERS], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    assert len(rules) == 2


def test_restricted_network_policy(rendered):
    docs = rendered["autoscaling"]
    _, transfer_rule, metrics_rule = one(docs, "NetworkPolicy", f"{FULL}-workers")["spec"]["ingress"]
    assert transfer_rule["ports"] == [{"port": "grpc", "protocol": "TCP"},
                                      {"port": 20000, "endPort": 20999, "protocol": "TCP"}]
    assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


def test_ingress_gateway_auth_pvc(rendered):
    docs = rendered["edge"]
    svc = one(docs, "Service", f"{FULL}-router")
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 80
    ing = one(docs, "Ingress", f"{FULL}-router")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{FULL}-router", "port": {"name": "http"}}
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["secretName"] == "llm-example-tls"
    route = one(docs, "HTTPRoute", f"{FULL}-router")["spec"]
    assert route["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    assert route["rules"][0]["backendRefs"] == [{"name": f"{FULL}-router", "port": 80}]
    assert route["rules"][0]["matches"][0]["path"] == {"type": "PathPrefix", "value": "/v1"}
    # auth: the router reads TANDEM_API_KEY from the created Secret
    router_dep = one(docs, "Deployment", f"{FULL}-router")
    router = container(router_dep)
    key_env = next(e for e in router["env"] if e["name"] == "TANDEM_API_KEY")
    ref = key_env["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret", ref["name"])
    import base64
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == "change-me-please"
    assert "checksum/auth" in router_dep["spec"]["template"]["metadata"]["annotations"]
    assert _flag(router["args"], "routing") == "round_robin"
    assert _flag(router["args"], "model-name") == "smollm2"
    assert "--max-queue=2048" in router["args"]
    # model on a PVC every pod mounts, filled by copying out of a model image
    pvc = one(docs, "PersistentVolumeClaim", f"{FULL}-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs-client"
    for dep in by_kind(docs, "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": f"{FULL}-models"}} in pod["volumes"]
        (init,) = pod["initContainers"]
        assert init["name"] == "copy-model" and init["image"] == "registry.example.com/tandem-models:smollm2-135m"
        assert init["command"] == ["cp", "-R", "/models/.", "/models"]


def test_existing_secret_claim_and_pod_monitor(rendered):
    docs = rendered["existing"]
    assert not by_kind(docs, "Secret") and not by_kind(docs, "PersistentVolumeClaim")
    assert not by_kind(docs, "NetworkPolicy") and not by_kind(docs, "ServiceAccount")
    router_dep = one(docs, "Deployment", f"{FULL}-router")
    router = container(router_dep)
    ref = next(e for e in router["env"] if e["name"] == "TANDEM_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "tandem-api-key", "key": "token"}
    assert router_dep["spec"]["template"]["spec"]["serviceAccountName"] == "tandem-router"
    for dep in by_kind(docs, "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "llm-models"}} in pod["volumes"]
    data = one(docs, "ConfigMap", f"{FULL}-config")["data"]
    assert data["TANDEM_MODEL"] == "/models/llama-3.2-1b-instruct" and data["TANDEM_KV_TRANSFER"] == "tcp"
    decode = container(one(docs, "Deployment", f"{FULL}-decode"))
    assert decode["readinessProbe"]["grpc"] == {"port": 50051}
    assert _flag(decode["args"], "metrics-port") == "9464"
    svc = one(docs, "Service", f"{FULL}-decode")
    assert "clusterIP" not in svc["spec"] and svc["spec"]["ports"][0]["name"] == "grpc"
    pm = one(docs, "PodMonitor", FULL)
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert not by_kind(docs, "ServiceMonitor")


def test_the_metrics_key_reaches_the_router_and_the_monitors(rendered):
    """metrics.key: a created Secret (autoscaling) or an existing one (existing), mounted
    in the router and passed as --metrics-key-file; the ServiceMonitor or PodMonitor sends
    it as a bearer token."""
    for name, kind, field, secret, key in (
            ("autoscaling", "ServiceMonitor", "endpoints", f"{FULL}-metrics-key", "metrics-key"),
            ("existing", "PodMonitor", "podMetricsEndpoints", "tandem-metrics-key", "token")):
        docs = rendered[name]
        dep = one(docs, "Deployment", f"{FULL}-router")
        c = container(dep)
        assert _flag(c["args"], "metrics-key-file") == f"/etc/tandem/metrics/{key}", name
        assert {"name": "metrics-key", "mountPath": "/etc/tandem/metrics",
                "readOnly": True} in c["volumeMounts"]
        assert {"name": "metrics-key", "secret": {"secretName": secret, "defaultMode": 0o400}} \
            in dep["spec"]["template"]["spec"]["volumes"]
        (endpoint,) = one(docs, kind, FULL)["spec"][field]
        assert endpoint["bearerTokenSecret"] == {"name": secret, "key": key}, name
    created = one(rendered["autoscaling"], "Secret", f"{FULL}-metrics-key")
    assert len(base64.b64decode(created["data"]["metrics-key"])) == 32


def test_a_public_router_service_carries_no_metrics_port(rendered):
    """A LoadBalancer (or NodePort) router Service exposes the API only; the router's
    metrics port gets a ClusterIP Service of its own, which the monitors select."""
    docs = rendered["edge"]
    public = one(docs, "Service", f"{FULL}-router")
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]
    private = one(docs, "Service", f"{FULL}-router-metrics")
    assert private["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"], p["targetPort"]) for p in private["spec"]["ports"]] == [
        ("metrics", 9100, "metrics")]
    assert private["spec"]["selector"] == public["spec"]["selector"]
    assert private["metadata"]["labels"] == public["metadata"]["labels"]


def test_created_api_key_is_random_when_not_given(chart):
    docs = render(chart, {"auth": {"enabled": True}})
    secret = one(docs, "Secret", f"{FULL}-auth")
    assert len(base64.b64decode(secret["data"]["api-key"])) == 32


@pytest.mark.parametrize("values, message", [
    ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, "not both"),
    ({"httpRoute": {"enabled": True}}, "parentRefs"),
    ({"config": {"kvTransfer": "tcp"}, "decode": {"tensorParallelSize": 6, "gpusPerNode": 4,
                                                  "gpu": {"enabled": True}}},
     "decode.tensorParallelSize 6 must be a multiple of decode.gpusPerNode 4"),
    ({"config": {"kvTransfer": "tcp"}, "prefill": {"tensorParallelSize": 16, "gpu": {"enabled": True},
                                                   "autoscaling": {"enabled": True}}},
     "prefill.autoscaling.enabled is not supported for a LeaderWorkerSet pool"),
])
def test_inconsistent_values_fail_rendering(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# -- values.schema.json -------------------------------------------------------------------------

SCHEMA_PATH = CHART / "values.schema.json"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    s = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft7Validator.check_schema(s)
    return s


@pytest.mark.parametrize("values, fragment", [
    ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
    ({"decode": {"gpu": {"enabled": "yes"}}}, "/decode/gpu/enabled"),
    ({"config": {"kvTransfer": "rdma"}}, "/config/kvTransfer"),
    ({"config": {"kvCacheDtype": "int4"}}, "/config/kvCacheDtype"),
    ({"router": {"port": 70000}}, "/router/port"),
    ({"decode": {"autoscaling": {"targetKvCacheUsage": "lots"}}}, "/decode/autoscaling/targetKvCacheUsage"),
    ({"prefill": {"tolerations": [{"key": "a", "operatr": "Exists"}]}}, "/prefill/tolerations/0"),
    ({"workers": {"probes": {"startup": {"periodSeconds": "5s"}}}}, "/workers/probes/startup/periodSeconds"),
    ({"router": {"metricsPort": 0}}, "/router/metricsPort"),
    ({"metrics": {"key": {"enabled": "yes"}}}, "/metrics/key/enabled"),
    ({"decode": {"tensorParallelSize": 0}}, "/decode/tensorParallelSize"),
    ({"workers": {"tensorParallel": {"rendezvousPort": 0}}}, "/workers/tensorParallel/rendezvousPort"),
])
def test_schema_rejects_wrong_types(chart, values, fragment):
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert fragment in str(e.value)
    with pytest.raises(helm.HelmValuesError):  # and install/template refuse it too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values", [
    {"replicaCount": 2},
    {"prefill": {"replica": 2}},
    {"router": {"service": {"nodePort": 30080}}},
    {"decode": {"autoscaling": {"targetCPU": 80}}},
    {"model": {"persistence": {"storageClass": "fast"}}},
    {"networkPolicy": {"workerTransfer": {"ports": [{"port": 1, "protocl": "TCP"}]}}},
    {"decode": {"affinity": {"nodeAfinity": {}}}},
    {"router": {"resources": {"limit": {"cpu": "1"}}}},
    {"metrics": {"key": {"secretName": "mine"}}},
])
def test_schema_rejects_unknown_keys(chart, values):
    with pytest.raises(helm.HelmValuesError, match="additional propert"):
        chart.validate_schema(values)
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["errors"], report


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        path = node["$ref"].removeprefix("#/").split("/")
        node = functools.reduce(lambda n, k: n[k], path, schema)
    return node


def test_schema_declares_every_value(schema):
    """Every key of values.yaml, at every depth, is a declared property (so the schema's
    closed objects can never reject the chart's own defaults, and no value goes unchecked)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing: list[str] = []

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        node = _resolve(schema, node)
        if isinstance(value, dict):
            props = node.get("properties")
            if props is None:
                assert isinstance(node.get("additionalProperties"), dict), f"{path}: open object"
                return
            for k, v in value.items():
                if k not in props:
                    missing.append(f"{path}.{k}")
                else:
                    walk(v, props[k], f"{path}.{k}")

    walk(values, schema, "")
    assert not missing, missing
    jsonschema.Draft7Validator(schema).validate(values)


def test_schema_objects_are_closed(schema):
    """additionalProperties: false on every object with properties; objects without
    properties are typed string maps (labels, annotations, nodeSelector, extra env)."""
    open_objects: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            if node.get("type") == "object" and "properties" not in node:
                if node.get("additionalProperties") not in ({"type": "string"},):
                    open_objects.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk({k: v for k, v in schema.items() if k != "definitions"}, "#")
    tandem_defs = {k: v for k, v in schema["definitions"].items() if not k.startswith("io.k8s.")}
    walk(tandem_defs, "#/definitions")
    assert not open_objects, open_objects


def test_schema_kubernetes_definitions_match_kubernetes_validate(schema):
    """The io.k8s.* definitions embedded in values.schema.json are the strict Kubernetes
    1.30 schemas (descriptions, formats and x-kubernetes-* extensions dropped)."""
    path = importlib.resources.files("kubernetes_validate").joinpath(
        "kubernetes-json-schema/v1.30.0-local-strict/_definitions.json")
    upstream = json.loads(path.read_text())["$defs"]

    def norm(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: (v.replace("#/$defs/", "#/definitions/") if k == "$ref" else norm(v))
                    for k, v in o.items()
                    if k not in ("description", "format") and not k.startswith("x-kubernetes-")}
        if isinstance(o, list):
            return [norm(x) for x in o]
        return o

    embedded = {k: v for k, v in schema["definitions"].items() if k.startswith("io.k8s.")}
    assert embedded
    for name, definition in embedded.items():
        assert definition == norm(upstream[name]), name
    # every reference resolves
    for ref in set(re.findall(r'"\$ref": "#/definitions/([^"]+)"', json.dumps(schema))):
        assert ref in schema["definitions"], ref
