"""Worker discovery: where the router learns its prefill and decode workers."""
from __future__ import annotations

from router.discovery.base import Discovery, WorkerEndpoint, get_discovery

__all__ = ["Discovery", "WorkerEndpoint", "get_discovery"]
