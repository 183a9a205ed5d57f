"""When a process traces: off unless --otlp-traces-endpoint or the OTEL_* endpoint
variables say so (then nothing of the SDK is even imported, and no interceptor or
middleware is in the path); on, the SDK's own variables apply. Every service's CLI,
and `tandem up`, take the flag; a bad URL is an error naming it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.config import RouterConfig
from tandem.cli import build_parser
from tracing.provider import traces_url

ROOT = Path(__file__).resolve().parents[2]

OFF = """
import sys
from opentelemetry import trace
from router.app import create_app
from router.config import RouterConfig
from tracing import provider, rpc
from tracing.http import HTTPSpans
app = create_app(RouterConfig(decode=("127.0.0.1:1",)))
worker_on = provider.configure("tandem-decode", None)  # what a worker does at start
print(provider.installed(), type(trace.get_tracer_provider()).__name__, worker_on,
      any(m.cls is HTTPSpans for m in app.user_middleware),
      rpc.client_interceptors(), rpc.server_interceptors(["/tandem.decode.Decode/Generate"]),
      sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")))
"""

ON = """
from opentelemetry import trace
from router.app import create_app
from router.config import RouterConfig
from tracing import provider, rpc
from tracing.http import HTTPSpans
app = create_app(RouterConfig(decode=("127.0.0.1:1",)))
p = provider.installed()
print(type(p).__name__, type(trace.get_tracer_provider()).__name__,
      p.resource.attributes["service.name"], p.sampler.get_description(),
      any(m.cls is HTTPSpans for m in app.user_middleware), len(rpc.client_interceptors()))
"""


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**clean, "PYTHONPATH": str(ROOT), **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_tracing_off_installs_no_provider_and_imports_no_sdk() -> None:
    assert _run(OFF) == "None ProxyTracerProvider False False [] [] []"
    # the endpoint variables turn it on; OTEL_SDK_DISABLED turns it off again
    assert _run(OFF, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
                OTEL_SDK_DISABLED="true") == "None ProxyTracerProvider False False [] [] []"


@pytest.mark.parametrize("env, want", [
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"},
     "TracerProvider ProxyTracerProvider tandem-router ParentBased{root:AlwaysOnSampler,"
     "remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
     "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler} True 2"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "edge-7",
      "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
     "TracerProvider ProxyTracerProvider edge-7 TraceIdRatioBased{0.25} True 2"),
])
def test_the_otel_variables_turn_it_on_and_the_sdk_reads_the_rest(env, want) -> None:
    assert _run(ON, **env) == want


def test_a_collector_url_gets_the_traces_path_and_a_bad_one_names_the_flag() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    for bad in ("localhost:4318", "grpc://c:4317", "http://"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint must be an http"):
            RouterConfig(otlp_traces_endpoint=bad)


def test_every_service_and_tandem_up_take_the_flag(tmp_path) -> None:
    from tandem.supervisor import Cluster

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("router", "prefill", "decode", "up"):
        action = next(a for a in sub.choices[command]._actions
                      if a.dest == "otlp_traces_endpoint")
        assert action.option_strings == ["--otlp-traces-endpoint"] and "OTLP/HTTP" in action.help
    args = parser.parse_args(["up", "--model", str(tmp_path), "--otlp-traces-endpoint",
                              "http://collector:4318"])
    cluster = Cluster(args, str(tmp_path))
    try:
        for child in cluster.workers + [cluster.router]:
            i = child.cmd.index("--otlp-traces-endpoint")
            assert child.cmd[i + 1] == "http://collector:4318", child.name
    finally:
        cluster._tmp.cleanup()
