"""Shared factories for the kvtransfer tests: deterministic KV tensors, a source
worker in a spawned process (backend + LeaseTable + KVLink gRPC server), and
the destination-side handshake/pull plumbing."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import pytest
import torch

from kvtransfer.base import (CompatRecord, KVCompatError, KVReader, ReadHandle, ReadPlan, SourceBlocks,
                             block_view, get_backend)

SHAPE = dict(num_blocks=32, num_layers=3, block_size=16, num_kv_heads=2, head_dim=16)
"""12 KiB (fp32) per block: small, but several blocks per socket buffer."""
FINGERPRINT = "test-model-v1"
TEST_SECRET = b"test-cluster-secret-0123456789"
SPAWN_TIMEOUT_S = 60.0


def make_kv(dtype: torch.dtype, seed: int, num_blocks: int = SHAPE["num_blocks"],
            block_size: int = SHAPE["block_size"]) -> torch.Tensor:
    """A random block-major KV tensor, identical in every process for a seed."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, SHAPE["num_layers"], 2, block_size, SHAPE["num_kv_heads"],
             SHAPE["head_dim"])
    return torch.randn(shape, generator=g).to(dtype)  # [N, L, 2, B, Hkv, D]


def assert_blocks_copied(dst: torch.Tensor, before: torch.Tensor, src: torch.Tensor,
                         plan: ReadPlan) -> None:
    """Byte-exact: every planned local block equals its remote block, every other
    local block is unchanged."""
    d, b, s = block_view(dst), block_view(before), block_view(src)
    for rb, lb in zip(plan.remote_block_ids, plan.local_block_ids):
        assert torch.equal(d[lb], s[rb]), f"local block {lb} != remote block {rb}"
    untouched = sorted(set(range(d.shape[0])) - set(plan.local_block_ids))
    assert torch.equal(d[untouched], b[untouched]), "a block outside the plan changed"


def _source_main(conn: Any, backend: str, dtype: torch.dtype, seed: int, fingerprint: str) -> None:
    """Spawn target: a prefill worker's transfer side, driven over ``conn``."""
    import grpc

    from kvtransfer.base import get_backend
    from kvtransfer.lease import LeaseTable
    from kvtransfer.link import KVLinkServicer, add_kv_link

    torch.set_num_threads(1)
    kv = make_kv(dtype, seed)
    leases = LeaseTable()
    freed: list[int] = []
    source = get_backend(backend).source()  # type: ignore[arg-type]
    source.register(kv, CompatRecord.from_kv(kv, fingerprint), leases.check_readable)
    source.serve("127.0.0.1", 0)
    servicer = KVLinkServicer(source, leases, lambda lease: freed.extend(lease.block_ids),
                              worker_id=f"src-{backend}-{seed}", secret=TEST_SECRET)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        add_kv_link(server, servicer)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    conn.send(("ready", f"127.0.0.1:{port}", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "grant":
            lease = leases.grant(*args)
            conn.send((lease.epoch, lease.deadline_unix_ms, lease.token))
        elif cmd == "active":
            conn.send(leases.active())
        elif cmd == "freed":
            conn.send(sorted(freed))
        elif cmd == "reap":
            conn.send(servicer.reap_expired())
        elif cmd == "pause":  # nixl: its progress thread stops, so wire-up with a new reader waits
            source._lock.acquire()
            conn.send(True)
        elif cmd == "resume":
            source._lock.release()
            conn.send(True)
        elif cmd == "stop":
            break
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    source.close()
    conn.send("stopped")


class SourceProcess:
    """A source worker in its own (spawned) process; a context manager."""

    def __init__(self, backend: str, dtype: torch.dtype, seed: int,
                 fingerprint: str = FINGERPRINT) -> None:
        self.backend, self.dtype, self.seed = backend, dtype, seed
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_source_main, args=(child, backend, dtype, seed, fingerprint),
                                daemon=True)
        self.proc.start()
        reply = self._recv(SPAWN_TIMEOUT_S)
        _, self.endpoint, self.pid = reply
        self.kv = make_kv(dtype, seed)  # what the source holds, rebuilt here from the seed

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"source process ({self.backend}) did not answer in {timeout_s}s")
        return self._conn.recv()

    def call(self, *cmd: Any, timeout_s: float = 20.0) -> Any:
        self._conn.send(cmd)
        return self._recv(timeout_s)

    def grant(self, request_id: str, block_ids: Sequence[int], ttl_s: float = 30.0) -> SourceBlocks:
        epoch, deadline_ms, token = self.call("grant", request_id, list(block_ids), ttl_s)
        return SourceBlocks(f"src-{self.backend}-{self.seed}", self.endpoint, request_id, epoch,
                            tuple(block_ids), deadline_ms, len(block_ids) * SHAPE["block_size"],
                            token)

    def active(self) -> int:
        return self.call("active")

    def freed(self) -> list[int]:
        return self.call("freed")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=15)
            except (OSError, EOFError, TimeoutError):
                pass
        self.proc.join(10)
        self.kill()

    def __enter__(self) -> SourceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def handshake_and_pull(reader: KVReader, compat: CompatRecord, endpoint: str, backend: str,
                             plan_of: Any) -> ReadHandle:
    """Handshake with the source at ``endpoint``, connect ``reader``, and pull
    ``plan_of(peer)`` through ``KVLinkClient.pull`` (read, then Release)."""
    from kvtransfer.link import KVLinkClient

    client = KVLinkClient(endpoint, "test-reader", TEST_SECRET)
    try:
        info = await client.handshake(compat, backend)
        peer = reader.connect(info)
        return await client.pull(reader, peer, plan_of(peer), timeout_s=20)
    finally:
        await client.close()


async def handshake(compat: CompatRecord, endpoint: str, backend: str) -> Any:
    from kvtransfer.link import KVLinkClient

    client = KVLinkClient(endpoint, "test-reader", TEST_SECRET)
    try:
        return await client.handshake(compat, backend)
    finally:
        await client.close()


async def release(endpoint: str, request_id: str, epoch: int, token: str) -> tuple[bool, str]:
    from kvtransfer.link import KVLinkClient

    client = KVLinkClient(endpoint, "test-reader", TEST_SECRET)
    try:
        return await client.release(request_id, epoch, token)
    finally:
        await client.close()


@dataclass
class Dest:
    """The destination's KV tensor and a snapshot to detect stray writes."""

    kv: torch.Tensor
    before: torch.Tensor
    compat: CompatRecord

    @classmethod
    def make(cls, dtype: torch.dtype, seed: int = 1234, fingerprint: str = FINGERPRINT,
             block_size: int = SHAPE["block_size"]) -> Dest:
        kv = make_kv(dtype, seed, block_size=block_size)
        return cls(kv, kv.clone(), CompatRecord.from_kv(kv, fingerprint))


def _dying_source_main(conn: Any, block_bytes: int) -> None:
    """Spawn target: speaks the TCP data protocol, sends half the promised
    bytes, then dies without closing anything (os._exit)."""
    from kvtransfer.tcp import recv_frame, send_frame
    from proto import kv_link_pb2 as pb

    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    request = recv_frame(sock, pb.ReadRequest)
    n = len(request.block_ids)
    send_frame(sock, pb.ReadHeader(status=pb.READ_OK, num_blocks=n, block_bytes=block_bytes))
    sock.sendall(b"\x5a" * (n * block_bytes // 2))
    os._exit(1)


def start_dying_source(block_bytes: int) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dying_source_main, args=(child, block_bytes), daemon=True)
    proc.start()
    if not parent.poll(SPAWN_TIMEOUT_S):
        proc.kill()
        raise TimeoutError("dying source did not start")
    return proc, parent.recv()


def assert_compat_mismatch_fails_at_connect(source: SourceProcess) -> None:
    """A reader whose cache differs from the source's is refused, naming the field: at the
    handshake (block_size) and at ``connect`` (model_fingerprint)."""
    wrong_size = Dest.make(source.dtype, block_size=8)
    with pytest.raises(KVCompatError, match="block_size: local 8 != remote 16"):
        asyncio.run(handshake(wrong_size.compat, source.endpoint, source.backend))
    info = asyncio.run(handshake(Dest.make(source.dtype).compat, source.endpoint, source.backend))
    other_model = Dest.make(source.dtype, fingerprint="another-model")
    rd = get_backend(source.backend).reader()
    rd.register(other_model.kv, other_model.compat)
    with pytest.raises(KVCompatError, match="model_fingerprint: local 'another-model'"):
        rd.connect(info)
    rd.close()


def plan_for(blocks: SourceBlocks, local_ids: Sequence[int]) -> Any:
    """A ``plan_of`` for ``handshake_and_pull``."""
    return lambda peer: ReadPlan.from_source(blocks, local_ids)
