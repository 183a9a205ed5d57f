"""Worker configs: one frozen dataclass per service, composed of the engine's."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kvtransfer.registry import KV_BACKENDS
from tracing.provider import traces_url


@dataclass(frozen=True)
class KVTransferConfig:
    """How KV blocks move between workers."""

    backend: str = "nixl"
    """KV transfer backend: nixl (UCX; CMA between processes of one host, RDMA across
    hosts), tcp (plain streaming fallback) or local (one process: tests)."""
    lease_ttl_s: float = 30.0
    """Prefill side: seconds a finished prefill's blocks stay pinned for a decode
    worker to pull before they are freed."""
    transfer_timeout_s: float = 10.0
    """Decode side: seconds to wait for one pull before recomputing the prompt."""

    def __post_init__(self) -> None:
        KV_BACKENDS.check(self.backend)
        if self.lease_ttl_s <= 0:
            raise ValueError(f"--lease-ttl-s must be > 0, got {self.lease_ttl_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"--transfer-timeout-s must be > 0, got {self.transfer_timeout_s}")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker process."""

    engine: EngineConfig
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    host: str = "127.0.0.1"
    """Address the gRPC services (and the TCP KV data port) bind to."""
    port: int = 0
    """gRPC port; 0 picks a free one (printed at startup)."""
    metrics_port: int | None = None
    """HTTP port for Prometheus /metrics; None = no metrics server."""
    worker_id: str = ""
    """Name in logs, traces and KV handles; default role@host:port."""
    advertise_host: str = ""
    """Address peers dial to reach this worker (written into KV handles, and a name its
    clients' cluster tokens may be made for); default: --host, or this machine's address
    when --host is a wildcard (0.0.0.0 in a pod)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: seconds to finish running requests (new ones are refused and health
    says NOT_SERVING) before the process exits."""
    cluster_secret_file: str | None = None
    """File holding the secret every router and worker of the cluster shares (RPCs
    without it are refused); default: $TANDEM_CLUSTER_SECRET, else a per-user file in
    the cache directory, created on first use."""
    kv_peers: tuple[str, ...] = ()
    """Decode side: prefill workers (host:port of their KVLink) this worker may pull KV
    from, besides those the routers' discovery lists (pushed with SetKVPeers)."""
    kv_events_endpoint: str = ""
    """ZMQ endpoint to publish KV events on in vLLM's format (BlockStored/BlockRemoved
    with the tier as medium), e.g. tcp://*:5557, for llm-d's or Dynamo's KV-aware routers
    (worker/kv_events_zmq.py); empty = none (Tandem's router reads StreamKVEvents)."""
    kv_events_replay_endpoint: str = ""
    """ZMQ ROUTER endpoint that replays buffered KV event batches to a subscriber that
    missed them, e.g. tcp://*:5558; needs --kv-events-endpoint."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP collector to export OpenTelemetry traces to, e.g. http://localhost:4318
    (/v1/traces is added to a URL without a path); default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing (docs/observability.md)."""

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            import socket
            return socket.gethostbyname(socket.gethostname())
        return self.host

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.otlp_traces_endpoint is not None:
            traces_url(self.otlp_traces_endpoint)
        tp = self.engine.parallel.tensor_parallel_size
        if tp > 1 and self.kv.backend == "local":  # in-process tests: one tensor only
            raise ValueError(f"--kv-transfer {self.kv.backend} is not supported with "
                             f"--tensor-parallel-size {tp} (a group's KV moves over "
                             f"--kv-transfer tcp or nixl; docs/tensor-parallel.md)")
