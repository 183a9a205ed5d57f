"""Admission control: at most ``max_inflight`` requests run at once, and a request
waits while the decode pool has no room for it (``room``: no decode worker's
reported free KV blocks can hold its prompt). The rest wait in per-priority order
(lower value first, then arrival), up to ``max_queue`` waiting; beyond that a request
is refused at once (HTTP 429 with Retry-After). A request whose deadline passes while
it waits is refused too (HTTP 504).

The KV check never strands a request: it is skipped when nothing is in flight (the
pool can only be full of cached blocks the worker will evict) and when a less
important request is in flight (the decode worker preempts it to make room). Worker
loads change without the router hearing of it, so the queue head is re-checked
every RECHECK_S as well as whenever a request ends.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from router.outcomes import DeadlineExceeded, QueueFull

RECHECK_S = 0.1


class Admission:
    def __init__(self, max_inflight: int, max_queue: int,
                 room: Callable[[int], bool] | None = None) -> None:
        """room(blocks): whether some decode worker can hold that many more blocks."""
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.room = room
        self.inflight = 0
        self._priorities: Counter[int] = Counter()
        """Priorities of the requests in flight."""
        self._heap: list[tuple[int, int, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._recheck: asyncio.Future | None = None
        self._recent_s = 1.0  # EWMA of request service time, for Retry-After

    @property
    def waiting(self) -> int:
        return len(self._heap)

    def _fits(self, priority: int, blocks: int) -> bool:
        if self.inflight >= self.max_inflight:
            return False
        if self.room is None or not blocks or not self.inflight or self.room(blocks):
            return True
        return max(self._priorities) > priority  # a less important one can be preempted

    @asynccontextmanager
    async def slot(self, priority: int, deadline: float | None = None,
                   blocks: int = 0) -> AsyncIterator[float]:
        """Hold one of the running slots; yields seconds spent queued. blocks: the KV
        blocks the request's prompt needs on a decode worker (0: don't check)."""
        t0 = time.monotonic()
        if self.waiting or not self._fits(priority, blocks):
            await self._wait(priority, blocks, deadline)
        else:
            self._take(priority)
        queued = time.monotonic() - t0
        try:
            yield queued
        finally:
            served = time.monotonic() - t0 - queued
            self._recent_s = 0.9 * self._recent_s + 0.1 * served
            self._release(priority)

    def _take(self, priority: int) -> None:
        self.inflight += 1
        self._priorities[priority] += 1

    async def _wait(self, priority: int, blocks: int, deadline: float | None) -> None:
        if self.waiting >= self.max_queue:
            per_slot = self._recent_s / max(1, self.max_inflight)
            raise QueueFull(self.waiting, max(1, round(self.waiting * per_slot)))
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._seq), blocks, fut))
        self._pump()  # it may head the queue and fit already
        if self.room is not None and self._recheck is None and not fut.done():
            self._recheck = asyncio.ensure_future(self._recheck_while_waiting())
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            if not fut.done():
                self._forget(fut)
                raise DeadlineExceeded("the request's deadline passed while it was queued") from None
        except asyncio.CancelledError:  # client gone while queued
            if fut.done() and not fut.cancelled():
                self._release(priority)  # we were given a slot: pass it on
            else:
                self._forget(fut)
            raise
        # fut done: _pump gave us the slot (inflight already counted)

    def _forget(self, fut: asyncio.Future) -> None:
        """A waiter gave up: out of the queue now (not left for _pump to skip)."""
        fut.cancel()
        self._heap = [e for e in self._heap if e[3] is not fut]
        heapq.heapify(self._heap)

    async def _recheck_while_waiting(self) -> None:
        """Worker loads change without the router hearing of it: one task re-checks
        the queue head every RECHECK_S while anyone waits."""
        try:
            while self.waiting:
                await asyncio.sleep(RECHECK_S)
                self._pump()
        finally:
            self._recheck = None

    def _pump(self) -> None:
        """Admit waiters from the head of the queue while they fit."""
        while self._heap:
            priority, _, blocks, fut = self._heap[0]
            if fut.done():  # cancelled: its client went away or its deadline passed
                heapq.heappop(self._heap)
                continue
            if not self._fits(priority, blocks):
                return
            heapq.heappop(self._heap)
            self._take(priority)
            fut.set_result(None)

    def _release(self, priority: int) -> None:
        self.inflight -= 1
        self._priorities[priority] -= 1
        if not self._priorities[priority]:
            del self._priorities[priority]
        self._pump()
