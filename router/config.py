"""The router's config (one frozen dataclass; the CLI is generated from it)."""
from __future__ import annotations

from dataclasses import dataclass


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
    """Prefill workers, host:port each."""
    decode: tuple[str, ...] = ()
    """Decode workers, host:port each."""
    local_prefill_threshold: int = 32
    """Prompts with at most this many uncached tokens are prefilled on the decode
    worker itself (conditional disaggregation); -1 = always local (colocated)."""
    routing: str = "prefix"
    """prefix (prefix overlap against load) or round_robin."""
    block_size: int = 16
    """Tokens per KV block; must match the workers (for prefix hashing)."""
    hash_seed: int = 0
    """Block hash seed; must match the workers."""
    default_max_tokens: int = 256
    """max_tokens when a request gives none."""
    request_timeout_s: float = 600.0
    """Upper bound on one request's life."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.decode:
            raise ValueError("--decode: at least one decode worker (host:port) is required")
        if self.routing not in ("prefix", "round_robin"):
            raise ValueError(f"--routing must be prefix or round_robin, got {self.routing!r}")
        if self.local_prefill_threshold < -1:
            raise ValueError("--local-prefill-threshold must be >= -1")
        for addr in self.prefill + self.decode:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {addr!r} is not host:port")
