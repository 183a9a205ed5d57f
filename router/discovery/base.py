"""The discovery contract and its registry.

A Discovery yields the *whole* current set of worker endpoints each time it
changes (not deltas), so a consumer that missed an update still converges.
The router's WorkerPool applies each set: new endpoints get channels, health
checks and KV event streams; vanished ones are closed and dropped from the
prefix index. Implementations are imported lazily (the kubernetes client is
only needed for Kubernetes discovery).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Literal

from core.registry import Registry

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class WorkerEndpoint:
    role: Role
    address: str
    """host:port of the worker's gRPC server."""


class Discovery(ABC):
    @abstractmethod
    def watch(self) -> AsyncIterator[frozenset[WorkerEndpoint]]:
        """Yield the full endpoint set now, then again on every change. Runs until
        cancelled; transient errors are retried inside (and logged), never raised."""


DISCOVERY: Registry[type[Discovery]] = Registry("discovery kind", "--discovery", {
    "static": "router.discovery.static:StaticDiscovery",
    "kubernetes": "router.discovery.kubernetes:KubernetesDiscovery",
})


def get_discovery(name: str, **kwargs) -> Discovery:
    return DISCOVERY.load(name)(**kwargs)
