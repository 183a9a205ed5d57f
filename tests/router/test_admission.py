"""Admission: running slots, per-priority queueing, 429/504, and the decode pool's
free KV blocks (requests wait while no decode worker can hold them)."""
from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, DeadlineExceeded, QueueFull


class Room:
    """A fake decode pool: free blocks the test sets."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, blocks: int) -> bool:
        return self.free >= blocks


async def hold(adm: Admission, priority: int, blocks: int, log: list, name: str,
               release: asyncio.Event, deadline: float | None = None) -> None:
    async with adm.slot(priority, deadline, blocks):
        log.append(name)
        await release.wait()


def run(coro):
    return asyncio.run(coro)


def test_slots_then_priority_order_then_queue_full() -> None:
    async def main():
        adm, log, go = Admission(1, 2), [], asyncio.Event()
        first = asyncio.create_task(hold(adm, 5, 0, log, "first", go))
        await asyncio.sleep(0)
        low = asyncio.create_task(hold(adm, 9, 0, log, "low", go))
        high = asyncio.create_task(hold(adm, 0, 0, log, "high", go))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as e:
            async with adm.slot(1):
                pass
        assert e.value.retry_after_s >= 1
        go.set()
        await asyncio.gather(first, low, high)
        return log, adm.inflight, adm.waiting

    log, inflight, waiting = run(main())
    assert log == ["first", "high", "low"] and inflight == 0 and waiting == 0


def test_waits_for_free_kv_blocks_and_rechecks_without_a_release() -> None:
    async def main():
        room = Room(free=10)
        adm, log, go = Admission(8, 8, room), [], asyncio.Event()
        a = asyncio.create_task(hold(adm, 0, 8, log, "a", go))
        await asyncio.sleep(0)
        room.free = 2  # a's prompt took the blocks
        b = asyncio.create_task(hold(adm, 0, 8, log, "b", go))
        await asyncio.sleep(0.25)
        assert log == ["a"] and adm.waiting == 1
        room.free = 9  # the worker freed blocks; nobody in the router released anything
        await asyncio.sleep(0.25)
        assert log == ["a", "b"]
        go.set()
        await asyncio.gather(a, b)

    run(main())


def test_kv_check_never_strands_a_request() -> None:
    """Nothing in flight: admitted although the pool reports no room (its blocks can
    only be evictable cache). A less important request in flight: admitted (the decode
    worker preempts it). An equally important one: waits."""
    async def main():
        room = Room(free=0)
        adm, log, go = Admission(8, 8, room), [], asyncio.Event()
        low = asyncio.create_task(hold(adm, 5, 4, log, "low", go))
        await asyncio.sleep(0)
        high = asyncio.create_task(hold(adm, 0, 4, log, "high", go))
        same = asyncio.create_task(hold(adm, 5, 4, log, "same", go))
        await asyncio.sleep(0.05)
        assert log == ["low", "high"]
        go.set()
        await asyncio.gather(low, high, same)
        assert log == ["low", "high", "same"] and adm.inflight == 0

    run(main())


def test_deadline_while_waiting_for_kv() -> None:
    async def main():
        loop = asyncio.get_running_loop()
        adm, log, go = Admission(8, 8, Room(free=0)), [], asyncio.Event()
        a = asyncio.create_task(hold(adm, 0, 4, log, "a", go))
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded):
            await hold(adm, 0, 4, log, "late", go, deadline=loop.time() + 0.15)
        assert adm.waiting == 0
        go.set()
        await a
        assert adm.inflight == 0

    run(main())


def test_cancelled_waiters_leave_the_queue() -> None:
    """Finding 11: a waiter whose client left stayed in the heap (only skipped later), so
    the queue grew with every abandoned request."""
    async def main():
        adm, go = Admission(1, 1000), asyncio.Event()
        holder = asyncio.create_task(hold(adm, 0, 0, [], "holder", go))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(hold(adm, 1, 0, [], f"w{i}", go)) for i in range(100)]
        await asyncio.sleep(0.01)
        assert adm.waiting == 100
        for t in waiters:
            t.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert adm.waiting == 0 and len(adm._heap) == 0
        go.set()
        await holder
        assert adm.inflight == 0
    run(main())
