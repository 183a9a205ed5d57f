"""Router metrics (Prometheus; vLLM-style names with a "tandem:" prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.trace import RequestPath

_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_E2E = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between tokens",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency",
                             buckets=_E2E, registry=r)
        self.requests = Counter("tandem:router_requests", "Requests by path and outcome",
                                ["path", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("tandem:router_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("tandem:router_generation_tokens", "Generated tokens",
                                         registry=r)
        self.predicted_hits = Counter("tandem:prefix_cache_hits_predicted",
                                      "Prompt tokens the router expected cached", registry=r)
        self.realized_hits = Counter("tandem:prefix_cache_hits_realized",
                                     "Prompt tokens the prefilling worker served from its prefix cache", registry=r)
        self.kv_bytes = Counter("tandem:router_kv_transfer_bytes",
                                "KV bytes moved for requests routed here", registry=r)
        self.queue_time = Histogram("tandem:request_queue_time_seconds",
                                    "Seconds a request waited in the router's priority queue",
                                    buckets=_TTFT, registry=r)
        self.in_flight = Gauge("tandem:router_requests_in_flight", "Requests in flight",
                               registry=r)
        self.healthy = Gauge("tandem:router_healthy_workers", "Healthy workers", ["role"],
                             registry=r)
        self.worker_kv_blocks = Gauge(
            "tandem:router_worker_kv_blocks",
            "Each worker's KV blocks as its last load report said (free: free or cached)",
            ["worker", "state"], registry=r)
        for role in ("prefill", "decode"):  # every series exists from the start
            self.healthy.labels(role=role)
        for path in RequestPath:
            for reason in ("stop", "length", "abort", "error"):
                self.requests.labels(path=path.value, finish_reason=reason)
