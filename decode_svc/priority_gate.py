"""Serve waiting coroutines in priority order: lower priority value first, then
arrival. Used by the decode worker for block reservations (one at a time, so
the most important request gets freed blocks first) and for KV pulls (a few
at a time per source and overall, most important first: decode_svc/peers.py)."""
from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from typing import AsyncIterator


class PriorityGate:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.holders = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()

    @asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        if self.holders < self.capacity and not self._heap:
            self.holders += 1
        else:
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._heap, (priority, next(self._seq), fut))
            try:
                await fut  # the releasing holder hands its place over (holders unchanged)
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
                return
        self.holders -= 1
