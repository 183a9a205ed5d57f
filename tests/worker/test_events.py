"""KV event fan-out: a subscriber that stops reading is cut off (its stream ends and
it resubscribes for a fresh snapshot) instead of its queue growing without bound;
load changes are pushed at most every LOAD_PERIOD_S, the latest value last."""
from __future__ import annotations

import asyncio

from engine.kv_cache import KVEvent, KVEventKind
from worker.events import LOAD_PERIOD_S, MAX_PENDING, KVEventHub


def test_a_stalled_subscriber_is_cut_off_not_buffered_forever() -> None:
    async def body():
        hub = KVEventHub(asyncio.get_running_loop())
        stalled, live = hub.subscribe(), hub.subscribe()
        event = [KVEvent(KVEventKind.STORED, b"h" * 32)]
        for _ in range(3 * MAX_PENDING):
            hub.publish(event)
            await asyncio.sleep(0)  # let the fan-out run
            while live.queue.qsize():
                live.queue.get_nowait()
        await asyncio.sleep(0.05)
        assert stalled.cut_off and stalled.queue.qsize() <= MAX_PENDING + 1
        items = [stalled.queue.get_nowait() for _ in range(stalled.queue.qsize())]
        assert items[-1] is None  # its stream ends here
        assert not live.cut_off
    asyncio.run(body())


def test_load_pushes_are_rate_limited_and_end_on_the_latest() -> None:
    async def body():
        hub = KVEventHub(asyncio.get_running_loop())
        sub = hub.subscribe()
        for _ in range(200):  # a burst of changes within one period
            hub.load_changed()
        await asyncio.sleep(3 * LOAD_PERIOD_S)
        pushes = sub.queue.qsize()
        assert 1 <= pushes <= 3  # the leading edge, then one trailing push
        hub.close()
    asyncio.run(body())
