"""The process's tracer provider.

Tracing is on when --otlp-traces-endpoint names a collector or the standard
variables do (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT), unless
OTEL_SDK_DISABLED=true. Only then is the SDK imported and a TracerProvider made, exporting
in batches over OTLP/HTTP (protobuf). It is Tandem's, not the global one
(trace.set_tracer_provider): FastAPI traces every request by itself once a global
provider exists, outside the router's edge guard (refused requests and health probes
too) and beside the router's own span (tracing/http.py). The SDK reads the rest
of the standard variables itself: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (our
default service name applies only when neither names one), OTEL_TRACES_SAMPLER(_ARG)
(default: parent-based, always on), OTEL_BSP_* (batching), OTEL_EXPORTER_OTLP_*
headers, timeout, compression and certificates. Off, ``tracer()`` is the API's no-op
tracer: a span costs one small object per request and phase, and records nothing.

OTLP over HTTP rather than gRPC: http/protobuf is the transport the OTLP spec makes
the default (port 4318; the Collector, Jaeger and Tempo all take it), it exports
through ``requests`` on the batch thread instead of a second, blocking gRPC client
beside the services' grpc.aio ones, and a test receives it with a plain http.server.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from opentelemetry import trace

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_PATH = "/v1/traces"
"""Where an OTLP/HTTP collector takes traces (the path a bare host:port URL gets)."""

_provider: trace.TracerProvider | None = None
_tracer: trace.Tracer = trace.NoOpTracer()


def traces_url(url: str, flag: str = "--otlp-traces-endpoint") -> str:
    """The collector's OTLP/HTTP traces URL: http(s)://host:port[/path], /v1/traces
    added when the path is empty. ValueError naming the flag otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} must be an http:// or https:// URL of an OTLP/HTTP "
                         f"collector (e.g. http://localhost:4318), got {url!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return parts.geturl()


def wanted(endpoint: str | None) -> bool:
    """Whether this process should trace: an endpoint given, or one in the environment."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint) or any(os.environ.get(v, "").strip() for v in ENDPOINT_VARIABLES)


def configure(service_name: str, endpoint: str | None = None) -> bool:
    """Install the SDK's TracerProvider with an OTLP/HTTP batch exporter when tracing is
    wanted (see the module docstring); True when tracing is on. Once per process: a
    second call keeps the first provider (one process, one exporter)."""
    if _provider is not None:
        return True
    if not wanted(endpoint):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    use(provider)
    return True


def use(provider: trace.TracerProvider | None) -> None:
    """Make provider this process's (None: off again). configure() calls it; tests call
    it with a provider that records in memory."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer("tandem") if provider is not None else trace.NoOpTracer()


def installed() -> trace.TracerProvider | None:
    """The provider spans go to; None while tracing is off."""
    return _provider


def enabled() -> bool:
    """Whether spans are recorded in this process."""
    return _provider is not None


def tracer() -> trace.Tracer:
    """Tandem's tracer: the installed provider's, else the API's no-op tracer."""
    return _tracer
