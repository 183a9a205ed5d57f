"""Admission control: at most ``max_inflight`` requests run at once; the rest wait
in per-priority order (lower value first, then arrival), up to ``max_queue``
waiting; beyond that a request is refused at once (HTTP 429 with Retry-After).
A request whose deadline passes while it waits is refused too (HTTP 504).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the request queue is full ({waiting} waiting); retry later")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    pass


class Admission:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.inflight = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._recent_s = 1.0  # EWMA of request service time, for Retry-After

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._heap if not f.done())

    @asynccontextmanager
    async def slot(self, priority: int, deadline: float | None = None) -> AsyncIterator[float]:
        """Hold one of the running slots; yields seconds spent queued."""
        t0 = time.monotonic()
        if self.inflight >= self.max_inflight or self.waiting:
            await self._wait(priority, deadline)
        else:
            self.inflight += 1
        queued = time.monotonic() - t0
        try:
            yield queued
        finally:
            served = time.monotonic() - t0 - queued
            self._recent_s = 0.9 * self._recent_s + 0.1 * served
            self._release()

    async def _wait(self, priority: int, deadline: float | None) -> None:
        if self.waiting >= self.max_queue:
            per_slot = self._recent_s / max(1, self.max_inflight)
            raise QueueFull(self.waiting, max(1, round(self.waiting * per_slot)))
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._seq), fut))
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            if not fut.done():
                fut.cancel()
                raise DeadlineExceeded("the request's deadline passed while it was queued") from None
        except asyncio.CancelledError:  # client gone while queued
            if fut.done() and not fut.cancelled():
                self._release()  # we were handed a slot: pass it on
            else:
                fut.cancel()
            raise
        # fut done: the slot was handed to us by _release (inflight already counted)

    def _release(self) -> None:
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)  # hand our slot over: inflight unchanged
                return
        self.inflight -= 1
