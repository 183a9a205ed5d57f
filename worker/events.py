"""Fan-out of prefix-cache events from the engine thread to gRPC subscribers."""
from __future__ import annotations

import asyncio

from engine.kv_cache import KVEvent


class KVEventHub:
    """publish() is called on the engine thread; subscribers read asyncio queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._subscribers: set[asyncio.Queue[list[KVEvent]]] = set()

    def publish(self, events: list[KVEvent]) -> None:
        if self._subscribers:
            self._loop.call_soon_threadsafe(self._fan_out, events)

    def _fan_out(self, events: list[KVEvent]) -> None:
        for q in self._subscribers:
            q.put_nowait(events)

    def close(self) -> None:
        """End every subscriber's stream (a None marks the end)."""
        for q in self._subscribers:
            q.put_nowait(None)

    def subscribe(self) -> asyncio.Queue[list[KVEvent]]:
        q: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)
