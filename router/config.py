"""The router's config (one frozen dataclass; the CLI is generated from it)."""
from __future__ import annotations

from dataclasses import dataclass

from core.kv.policy import parse_kv_policy
from router.discovery.base import DISCOVERY
from tracing.provider import traces_url


@dataclass(frozen=True)
class RouterConfig:
    model: str = ""
    """Model path: the router loads only its tokenizer and chat template."""
    model_name: str = ""
    """Name served in /v1/models and accepted in requests; default: the file's stem."""
    host: str = "127.0.0.1"
    """HTTP bind address."""
    port: int = 8000
    """HTTP port."""
    prefill: tuple[str, ...] = ()
    """Prefill workers, host:port each (static discovery)."""
    decode: tuple[str, ...] = ()
    """Decode workers, host:port each (static discovery)."""
    discovery: str = "static"
    """static (flags, else --workers-file, else TANDEM_PREFILL/TANDEM_DECODE) or kubernetes
    (watch the EndpointSlices of labelled prefill and decode Services)."""
    workers_file: str | None = None
    """YAML file with prefill: [host:port, ...] and decode: [...] (static discovery)."""
    k8s_namespace: str | None = None
    """Namespace to watch; default: the pod's own namespace, else 'default'."""
    k8s_prefill_selector: str = "app.kubernetes.io/component=prefill"
    """Label selector of the prefill Service's EndpointSlices."""
    k8s_decode_selector: str = "app.kubernetes.io/component=decode"
    """Label selector of the decode Service's EndpointSlices."""
    k8s_port_name: str = "grpc"
    """Name of the workers' gRPC port in the EndpointSlices."""
    local_prefill_threshold: int | None = 32
    """Prompts with at most this many uncached tokens are prefilled on the decode
    worker itself (conditional disaggregation); none = always local (colocated)."""
    routing: str = "prefix"
    """prefix (prefix overlap against load) or round_robin."""
    block_size: int = 16
    """Tokens per KV block; must match the workers (for prefix hashing)."""
    hash_seed: int = 0
    """Block hash seed; must match the workers."""
    max_model_len: int = 8192
    """Context window of the workers (prompt + output); requests beyond it get 400."""
    kv_policy: str = "full"
    """The workers' --kv-policy (must match them): a request naming no kv_policy runs
    under it, so a bounded one's length is checked against --max-stream-len instead."""
    max_stream_len: int = 1 << 20
    """The workers' --max-stream-len: most tokens (prompt + output) of a request under a
    bounded kv_policy, which may run past --max-model-len; requests beyond it get 400."""
    default_max_tokens: int = 256
    """max_tokens when a request gives none."""
    request_timeout_s: float = 600.0
    """Upper bound on one request's life (x-request-timeout may lower it per request)."""
    priority_preemption: bool = True
    """Let a decode worker whose KV pool is full preempt less important running
    requests (swap or recompute) to admit a more important one."""
    max_inflight: int = 256
    """Requests dispatched to workers at once; more wait in the priority queue."""
    max_queue: int = 1024
    """Requests allowed to wait; beyond that the router answers 429 with Retry-After."""
    api_key: str | None = None
    """Require 'Authorization: Bearer KEY' on /v1 (visible in ps: prefer --api-keys-file
    or $TANDEM_API_KEY, which may list several keys separated by commas)."""
    api_keys_file: str | None = None
    """YAML file of API keys, each with an optional priority_ceiling and rate_limit_rps
    (README, "API keys"); re-read when it changes."""
    metrics_key_file: str | None = None
    """File holding the key /metrics requires (Bearer); default: $TANDEM_METRICS_KEY, else
    /metrics is open (keep it off the public address: --metrics-port, a NetworkPolicy)."""
    admin_key_file: str | None = None
    """File holding the key the admin endpoints require (Bearer): POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter. Default: $TANDEM_ADMIN_KEY, else
    those endpoints answer 403 (run-time adapter changes are off)."""
    metrics_port: int | None = None
    """Serve /metrics on this port of --host instead of --port, which then carries only
    the API (its /metrics answers 404); 0 picks a free port. Default: /metrics on --port."""
    docs: bool = True
    """Serve /docs, /redoc and /openapi.json (behind the API key when keys are set)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    max_connections: int = 1024
    """Client connections held at once; one beyond gets 429 with Retry-After and is closed."""
    read_timeout_s: float = 30.0
    """Seconds a client has to send a request's head, and again its body (408 after)."""
    write_timeout_s: float = 30.0
    """Seconds one write of a response may wait for a client that does not read it;
    after that the request is ended (everything it holds freed) and the connection closed."""
    log_requests: str | None = None
    """Append one JSON line per finished request (its trace) to this file."""
    cluster_secret_file: str | None = None
    """File holding the secret every router and worker of the cluster shares; default:
    $TANDEM_CLUSTER_SECRET, else a per-user file in the cache directory."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP collector to export OpenTelemetry traces to, e.g. http://localhost:4318
    (/v1/traces is added to a URL without a path); default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing (docs/observability.md)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not (
                0 <= self.metrics_port < 65536 and (self.metrics_port != self.port or self.port == 0)):
            raise ValueError(f"--metrics-port must be in [0, 65535] and not --port "
                             f"({self.port}), got {self.metrics_port}")
        DISCOVERY.check(self.discovery)
        parse_kv_policy(self.kv_policy, "--kv-policy")
        if self.max_stream_len < 2:
            raise ValueError(f"--max-stream-len must be >= 2, got {self.max_stream_len}")
        if self.otlp_traces_endpoint is not None:
            traces_url(self.otlp_traces_endpoint)
        if self.routing not in ("prefix", "round_robin"):
            raise ValueError(f"--routing must be prefix or round_robin, got {self.routing!r}")
        for name in ("max_inflight", "max_queue", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.local_prefill_threshold is not None and self.local_prefill_threshold < 0:
            raise ValueError(f"--local-prefill-threshold must be >= 0 (or none: always "
                             f"local), got {self.local_prefill_threshold}")

    def make_discovery(self):
        """The Discovery this config asks for; a static list without a decode worker
        is an error naming --decode."""
        from router.discovery import get_discovery
        from router.discovery.static import static_endpoints

        if self.discovery == "static":
            eps = static_endpoints(self.prefill, self.decode, self.workers_file)
            if not any(e.role == "decode" for e in eps):
                raise ValueError("--decode: at least one decode worker (host:port) is required "
                                 "(or --workers-file, or TANDEM_DECODE)")
            return get_discovery("static", endpoints=eps)
        return get_discovery("kubernetes", namespace=self.k8s_namespace,
                             selectors={"prefill": self.k8s_prefill_selector,
                                        "decode": self.k8s_decode_selector},
                             port_name=self.k8s_port_name)
