"""The router's worker pool: a health blip keeps a worker's prefix index; a worker
that discovery drops drains (no new work, channel kept) until its requests end."""
from __future__ import annotations

import asyncio

from engine.kv_cache import BlockHash
from router.discovery.base import WorkerEndpoint
from router.workers import WorkerPool

H = BlockHash(b"\x01" * 32)


def test_a_failed_health_check_keeps_the_prefix_index() -> None:
    """Finding 9: one failed health check wiped the worker's index, and it was rebuilt
    only when its event stream restarted (never, while the stream stayed up)."""
    async def body():
        pool = WorkerPool()
        await pool.apply(frozenset({WorkerEndpoint("decode", "127.0.0.1:9")}))
        w = pool.workers[0]
        pool.index.stored(w.address, H)
        pool.mark_down(w)
        assert pool.index.overlap(w.address, [H])[0] == 1
        await pool.stop()
        assert pool.index.overlap(w.address, [H])[0] == 0  # gone for real: dropped
    asyncio.run(body())


def test_a_worker_discovery_drops_drains_before_it_is_closed() -> None:
    """Finding 10: an endpoint turning terminating closed its channel at once, cutting
    every stream on it."""
    async def body():
        pool = WorkerPool(drain_timeout_s=30)
        ep = WorkerEndpoint("decode", "127.0.0.1:9")
        await pool.apply(frozenset({ep}))
        w = pool.workers[0]
        w.healthy, w.inflight = True, 1
        await pool.apply(frozenset())
        assert w in pool.workers and w.draining and pool.healthy("decode") == []
        await asyncio.sleep(0.3)
        assert w in pool.workers  # still serving its request
        await pool.apply(frozenset({ep}))  # listed again: back, not reconnected
        assert pool.workers == [w] and not w.draining
        await pool.apply(frozenset())
        w.inflight = 0
        for _ in range(30):
            if w not in pool.workers:
                break
            await asyncio.sleep(0.1)
        assert w not in pool.workers
        await pool.stop()
    asyncio.run(body())
