"""The in-process backend, and the KVLink gRPC handoff end to end in one process."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from kvtransfer.base import (CompatRecord, KVCompatError, LeaseError, PeerId, ReadPlan,
                             SourceBlocks, TransferState, get_backend)
from kvtransfer.lease import LeaseTable
from kvtransfer.link import KVLinkServicer, add_kv_link, blocks_from_proto, blocks_to_proto
from tests.kvtransfer.utils import (TEST_SECRET, FINGERPRINT, Dest, assert_blocks_copied, handshake,
                                    handshake_and_pull, make_kv, plan_for)


class Worker:
    """An in-process source: kv, lease table, local backend source."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kv = make_kv(dtype, seed=7)
        self.leases = LeaseTable()
        self.freed: list[int] = []
        self.source = get_backend("local").source()
        self.source.register(self.kv, CompatRecord.from_kv(self.kv, FINGERPRINT),
                             self.leases.check_readable)
        self.source.serve()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def worker(request: pytest.FixtureRequest):
    w = Worker(request.param)
    yield w
    w.source.close()
    assert w.leases.active() == 0, "leak: lease left active"


def make_reader(dest: Dest):
    reader = get_backend("local").reader()
    reader.register(dest.kv, dest.compat)
    return reader


def test_read_subset_into_other_local_blocks(worker: Worker) -> None:
    dest = Dest.make(worker.kv.dtype)
    reader = make_reader(dest)
    peer = reader.connect(worker.source.handshake_info("src"))
    lease = worker.leases.grant("r1", [3, 4, 5, 20], ttl_s=10)
    plan = ReadPlan("r1", lease.epoch, (3, 4, 5, 20), (10, 0, 1, 31), lease.token)
    handle = reader.start_read(peer, plan)
    assert reader.wait(handle, 1) is TransferState.DONE and handle.error is None
    assert handle.nbytes == 4 * worker.source.handshake_info("src").block_bytes
    assert_blocks_copied(dest.kv, dest.before, worker.kv, plan)
    assert worker.leases.release("r1", lease.epoch, lease.token) == [3, 4, 5, 20]
    assert reader.in_flight() == 0
    reader.close()


def test_compat_mismatch_fails_at_connect(worker: Worker) -> None:
    info = worker.source.handshake_info("src")
    for dest, field in [(Dest.make(worker.kv.dtype, block_size=8), "block_size: local 8 != remote 16"),
                        (Dest.make(worker.kv.dtype, fingerprint="other"), "model_fingerprint")]:
        reader = make_reader(dest)
        with pytest.raises(KVCompatError, match=field):
            reader.connect(info)
        reader.close()


def test_expired_or_released_lease_read_fails(worker: Worker) -> None:
    dest = Dest.make(worker.kv.dtype)
    reader = make_reader(dest)
    peer = reader.connect(worker.source.handshake_info("src"))
    lease = worker.leases.grant("r", [1, 2], ttl_s=0.05)
    time.sleep(0.08)
    handle = reader.start_read(peer, ReadPlan("r", lease.epoch, (1, 2), (0, 1), lease.token))
    assert handle.state is TransferState.EXPIRED and isinstance(handle.error, LeaseError)
    assert "expired" in str(handle.error)
    assert [x.request_id for x in worker.leases.expire()] == ["r"]
    lease = worker.leases.grant("r", [1, 2], ttl_s=10)
    worker.leases.release("r", lease.epoch, lease.token)
    handle = reader.start_read(peer, ReadPlan("r", lease.epoch, (1,), (0,), lease.token))
    assert handle.state is TransferState.EXPIRED and "released" in str(handle.error)
    blocks_outside = reader.start_read(peer, ReadPlan("x", 1, (1,), (0,)))
    assert blocks_outside.state is TransferState.EXPIRED
    assert torch.equal(dest.kv, dest.before), "a refused read wrote bytes"


def test_malformed_plans_rejected_before_any_byte_moves(worker: Worker) -> None:
    dest = Dest.make(worker.kv.dtype)
    reader = make_reader(dest)
    peer = reader.connect(worker.source.handshake_info("src"))
    lease = worker.leases.grant("r", [1, 2], ttl_s=10)
    with pytest.raises(ValueError, match="remote block id 99"):
        reader.start_read(peer, ReadPlan("r", lease.epoch, (1, 99), (0, 1), lease.token))
    with pytest.raises(ValueError, match="local block id 32"):
        reader.start_read(peer, ReadPlan("r", lease.epoch, (1, 2), (0, 32), lease.token))
    with pytest.raises(KeyError):
        reader.start_read(PeerId("nobody"), ReadPlan("r", lease.epoch, (1,), (0,), lease.token))
    assert torch.equal(dest.kv, dest.before)
    worker.leases.release("r", lease.epoch, lease.token)


async def _serve(worker: Worker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_kv_link(server, KVLinkServicer(worker.source, worker.leases,
                                       lambda lease: worker.freed.extend(lease.block_ids), "src",
                                       TEST_SECRET))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_link_handshake_pull_and_release(worker: Worker) -> None:
    """The whole handoff through grpc.aio: handshake, read, Release frees once."""
    dest = Dest.make(worker.kv.dtype)
    reader = make_reader(dest)

    async def scenario() -> None:
        server, endpoint = await _serve(worker)
        try:
            lease = worker.leases.grant("r1", [8, 9, 2], ttl_s=10)
            blocks = SourceBlocks("src", endpoint, "r1", lease.epoch, lease.block_ids,
                                  lease.deadline_unix_ms, 40, lease.token)
            assert blocks_from_proto(blocks_to_proto(blocks)) == blocks
            handle = await handshake_and_pull(reader, dest.compat, endpoint, "local",
                                              plan_for(blocks, [5, 6, 7]))
            assert handle.state is TransferState.DONE, handle.error
            assert_blocks_copied(dest.kv, dest.before, worker.kv, handle.plan)
            assert worker.freed == [8, 9, 2]
            # An expired lease: the pull reports EXPIRED, Release frees via reaping.
            lease = worker.leases.grant("r2", [11], ttl_s=0.05)
            await asyncio.sleep(0.08)
            blocks = SourceBlocks("src", endpoint, "r2", lease.epoch, (11,), 0, 16, lease.token)
            handle = await handshake_and_pull(reader, dest.compat, endpoint, "local",
                                              plan_for(blocks, [20]))
            assert handle.state is TransferState.EXPIRED and isinstance(handle.error, LeaseError)
            assert worker.freed == [8, 9, 2, 11]
            bad = Dest.make(worker.kv.dtype, block_size=8)
            with pytest.raises(KVCompatError, match="block_size: local 8 != remote 16"):
                await handshake(bad.compat, endpoint, "local")
            with pytest.raises(KVCompatError, match="backend"):
                await handshake(dest.compat, endpoint, "tcp")
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    reader.close()
