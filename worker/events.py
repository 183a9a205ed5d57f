"""Fan-out of prefix-cache events and load changes from the engine thread to the
routers subscribed to this worker (StreamKVEvents).

Each subscriber has a bounded queue. One that falls more than MAX_PENDING batches
behind is cut off: its stream ends and the router resubscribes, getting a fresh
snapshot, instead of the worker buffering without bound for a stalled reader.

Load is pushed when it changes (a free too, not only a store or an evict), at most
every LOAD_PERIOD_S and always with the latest value after a burst, so a router's
view of free blocks never stays at a mid-burst number.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.kv_cache import KVEventKind
from engine.kv_cache.tiers.events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST, TierEvent
from proto import common_pb2 as common

log = logging.getLogger(__name__)

MAX_PENDING = 1024
"""Batches a subscriber may fall behind before it is cut off."""
LOAD_PERIOD_S = 0.05


@dataclass
class Update:
    """One item of a subscriber's queue: cache events, or None for a load-only push."""

    events: list[TierEvent] | None


class Subscription:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Update | None] = asyncio.Queue()
        self.cut_off = False

    def offer(self, item: Update | None) -> None:
        if self.cut_off:
            return
        if item is not None and self.queue.qsize() >= MAX_PENDING:
            self.cut_off = True
            log.warning("a KV event subscriber fell %d batches behind; ending its stream "
                        "(it resubscribes and gets a fresh snapshot)", MAX_PENDING)
            item = None
        self.queue.put_nowait(item)


class KVEventHub:
    """publish() and load_changed() are called on the engine thread; subscribers read
    their queues on the event loop (None ends a stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._subscribers: set[Subscription] = set()
        self._load_dirty = False
        self._load_timer: asyncio.TimerHandle | None = None

    def publish(self, events: list[TierEvent]) -> None:
        self._loop.call_soon_threadsafe(self._fan_out, Update(events))

    def load_changed(self) -> None:
        self._loop.call_soon_threadsafe(self._mark_load)

    def _fan_out(self, item: Update | None) -> None:
        for sub in list(self._subscribers):
            sub.offer(item)

    def _mark_load(self) -> None:
        self._load_dirty = True
        if self._load_timer is None:
            self._push_load()

    def _push_load(self) -> None:
        """Leading edge now, then at most one push per LOAD_PERIOD_S while changes come."""
        if not self._load_dirty:
            self._load_timer = None
            return
        self._load_dirty = False
        self._fan_out(Update(None))
        self._load_timer = self._loop.call_later(LOAD_PERIOD_S, self._push_load)

    def close(self) -> None:
        """End every subscriber's stream."""
        if self._load_timer is not None:
            self._load_timer.cancel()
        self._fan_out(None)

    def subscribe(self) -> Subscription:
        sub = Subscription()
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)


_KINDS = {KVEventKind.STORED: common.KVEvent.STORED, KVEventKind.REMOVED: common.KVEvent.REMOVED}
_MEDIA = {MEDIUM_DEVICE: common.KVEvent.DEVICE, MEDIUM_HOST: common.KVEvent.HOST,
          MEDIUM_DISK: common.KVEvent.DISK}


def events_to_proto(events: list[TierEvent]) -> list[common.KVEvent]:
    """Each event with its tier (the tokens stay on the worker: the router hashes)."""
    return [common.KVEvent(kind=_KINDS[e.kind], block_hash=e.block_hash, medium=_MEDIA[e.medium])
            for e in events]
