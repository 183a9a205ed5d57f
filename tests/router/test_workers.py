"""The router's worker pool: a health blip keeps a worker's prefix index; a worker
that discovery drops drains (no new work, channel kept) until its requests end."""
from __future__ import annotations

import asyncio
import logging

from auth.grpc_auth import ServerAuth
from auth.targets import server_names
from core.kv import BlockHash
from proto import common_pb2, decode_pb2, decode_pb2_grpc
from router.discovery.base import WorkerEndpoint
from router.workers import WorkerPool
from worker.server import add_health_and_reflection, new_server

H = BlockHash(b"\x01" * 32)
SECRET = b"router-test-cluster-secret-0123456789"


def test_a_failed_health_check_keeps_the_prefix_index() -> None:
    """Finding 9: one failed health check wiped the worker's index, and it was rebuilt
    only when its event stream restarted (never, while the stream stayed up)."""
    async def body():
        pool = WorkerPool(SECRET)
        await pool.apply(frozenset({WorkerEndpoint("decode", "127.0.0.1:9")}))
        w = pool.workers[0]
        pool.index.stored(w.address, H)
        pool.mark_down(w)
        assert pool.index.overlap(w.address, [H]).reported == 1
        await pool.stop()
        assert pool.index.overlap(w.address, [H]).reported == 0  # gone for real: dropped
    asyncio.run(body())


def test_a_worker_discovery_drops_drains_before_it_is_closed() -> None:
    """Finding 10: an endpoint turning terminating closed its channel at once, cutting
    every stream on it."""
    async def body():
        pool = WorkerPool(SECRET, drain_timeout_s=30)
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


class _Decode(decode_pb2_grpc.DecodeServicer):
    async def GetLoad(self, request, context):
        return common_pb2.WorkerLoad(free_blocks=7)

    async def SetKVPeers(self, request, context):
        return decode_pb2.KVPeersReply()


async def _decode_worker(secret: bytes):
    auth = ServerAuth(secret)
    server = new_server(auth)
    decode_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
    add_health_and_reflection(server, ["tandem.decode.Decode"])
    port = server.add_insecure_port("127.0.0.1:0")
    auth.answer_to(server_names("127.0.0.1", port, "127.0.0.1"))
    await server.start()
    return server, port


async def _healthy_after(pool: WorkerPool, address: str, seconds: float) -> bool:
    await pool.apply(frozenset({WorkerEndpoint("decode", address)}))
    for _ in range(int(seconds * 10)):
        if pool.workers[0].healthy:
            break
        await asyncio.sleep(0.1)
    return pool.workers[0].healthy


def test_a_worker_on_another_cluster_secret_stays_out_of_the_pool(caplog) -> None:
    """Its health service answers anyone, so a plain health check said SERVING and the
    router sent it requests that could only fail UNAUTHENTICATED (HTTP 500)."""
    async def body():
        server, port = await _decode_worker(b"another-cluster-secret-value-000000")
        pool = WorkerPool(SECRET)
        with caplog.at_level(logging.WARNING, logger="router.workers"):
            assert not await _healthy_after(pool, f"127.0.0.1:{port}", 3.0)
        assert pool.healthy("decode") == []
        assert "refuses this router's credentials" in caplog.text
        assert "--cluster-secret-file" in caplog.text
        await pool.stop()
        await server.stop(None)
    asyncio.run(body())


def test_a_worker_on_the_same_secret_joins_with_its_load() -> None:
    async def body():
        server, port = await _decode_worker(SECRET)
        pool = WorkerPool(SECRET)
        assert await _healthy_after(pool, f"127.0.0.1:{port}", 10.0)
        assert pool.workers[0].load.free_blocks == 7
        await pool.stop()
        await server.stop(None)
    asyncio.run(body())
