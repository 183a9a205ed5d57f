"""What the router records of one request: the path it took through the cluster, the
workers, the cache hits, the KV moved and the fallbacks. One line of the request log
(--log-requests) and the attributes of the request's span (router/spans.py) are this,
flattened by ``Trace.fields``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from core.states import FallbackReason


class RequestPath(Enum):
    """How the prompt was prefilled (the ``path`` label of tandem:router_requests_total)."""

    DISAGGREGATED = "disaggregated"
    """On a prefill worker; the decode worker pulled its KV."""
    LOCAL_PREFILL = "local_prefill"
    """On the decode worker itself (conditional disaggregation)."""


class Failover(Enum):
    """A worker failed and another took the request over (the trace's fallback when
    no KV fallback came first)."""

    PREFILL = "prefill_failover"
    DECODE = "decode_failover"

    @classmethod
    def of(cls, role: str) -> Failover:
        """The failover of a worker of this role ("prefill" or "decode")."""
        return cls(f"{role}_failover")


@dataclass
class Trace:
    request_id: str
    client_request_id: str = ""
    """The client's x-request-id, if it sent one (echoed and logged, never a key)."""
    path: RequestPath | None = None
    """None until placed (a request refused before, e.g. by the queue)."""
    prefill_worker: str = ""
    decode_worker: str = ""
    lora: str = ""
    """The LoRA adapter it ran under (the request's model field), "": the base model."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    predicted_cached_tokens: int = 0
    """Prompt tokens the chosen worker's KV events said it held (the one that prefills)."""
    realized_cached_tokens: int = 0
    """Prompt tokens that worker really served from its prefix cache: the prefill
    worker's on the disaggregated path, the decode worker's on the local one."""
    realized_host_cached_tokens: int = 0
    realized_disk_cached_tokens: int = 0
    """Of realized_cached_tokens, those that worker promoted from its host-memory tier
    and from its disk tier for this request (docs/kv-offload.md); the rest were on its
    device."""
    decode_cached_tokens: int = 0
    """Prompt tokens the decode worker already held, so it did not pull them."""
    decode_host_cached_tokens: int = 0
    decode_disk_cached_tokens: int = 0
    """Of decode_cached_tokens, those the decode worker promoted from its host-memory
    and disk tiers (on the local path, the realized_* ones again)."""
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    transfer_seconds: float = 0.0
    fallback: FallbackReason | Failover | None = None
    """The last KV fallback a decode worker reported, else the first failover."""
    retries: int = 0
    """Workers replaced after a failure (prefill before its first token, decode mid-stream)."""
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    """Speculative decoding on the decode workers (summed over attempts)."""
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    e2e_seconds: float = 0.0

    def fields(self) -> dict[str, object]:
        """Every field as a plain value: a state as its value's string, none as ""."""
        out = dict(vars(self))
        out["path"] = self.path.value if self.path is not None else ""
        out["fallback"] = self.fallback.value if self.fallback is not None else ""
        return out

    def json(self) -> str:
        return json.dumps(self.fields(), sort_keys=True)
