"""The LoRA adapters the router offers: those its healthy workers say they serve
(WorkerLoad.loras, refreshed with every load report), less any being unloaded, and the
requests of this router that run under each (an unload waits for them).

A request's ``model`` field names the base model or one of these adapters; the flow
then places it only on workers serving that adapter (router/flow.py), and with the
adapter's identity in its block hashes (the same salt the worker's engine uses).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from proto import common_pb2 as common
from router.workers import Worker, WorkerPool

POLL_S = 0.05


class RouterLoRAs:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.unloading: set[str] = set()
        """Names an unload is under way for: refused to new requests."""
        self.inflight: Counter[str] = Counter()
        """Requests of this router running under each adapter."""

    def workers(self) -> list[Worker]:
        """Every worker that may take work (both roles)."""
        return self.pool.healthy("prefill") + self.pool.healthy("decode")

    def served(self) -> dict[str, common.LoRAAdapter]:
        """Adapter name -> how a worker serving it describes it (by name)."""
        out: dict[str, common.LoRAAdapter] = {}
        for w in self.workers():
            for name, adapter in w.loras.items():
                out.setdefault(name, adapter)
        return {n: out[n] for n in sorted(out) if n not in self.unloading}

    def offers(self, name: str) -> bool:
        """Some healthy decode worker serves this adapter, and no unload is under way."""
        return name not in self.unloading and any(
            name in w.loras for w in self.pool.healthy("decode"))

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        """A request of this router runs under the adapter (no-op for the base model)."""
        if not name:
            yield
            return
        self.inflight[name] += 1
        try:
            yield
        finally:
            self.inflight[name] -= 1
            if not self.inflight[name]:
                del self.inflight[name]

    async def drained(self, name: str) -> None:
        """Until no request of this router runs under the adapter."""
        while self.inflight.get(name):
            await asyncio.sleep(POLL_S)
