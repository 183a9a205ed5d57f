"""TCP backend across two processes: the source runs in a spawned process."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest
import torch

from kvtransfer.base import (LeaseError, PeerId, ReadHandle, ReadPlan,
                             SourceInfo, TransferState)
from kvtransfer.lease import ReleaseReason
from kvtransfer.link import KVLinkClient
from kvtransfer.tcp import recv_frame, send_frame
from proto import kv_link_pb2 as pb
from tandem.process import free_port
from tests.kvtransfer.utils import (TEST_SECRET, SourceProcess, assert_blocks_copied,
                                    assert_compat_mismatch_fails_at_connect, handshake,
                                    handshake_and_pull, plan_for, release, start_dying_source)


BACKEND, SOURCE_SEED = "tcp", 11
"""What the ``source`` and ``reader`` fixtures (conftest.py) serve and read with."""


def connect(reader, source: SourceProcess) -> tuple[PeerId, SourceInfo]:
    info = asyncio.run(handshake(reader.dest.compat, source.endpoint, "tcp"))
    return reader.connect(info), info


def test_read_subset_cross_process(source: SourceProcess, reader) -> None:
    blocks = source.grant("r1", [3, 4, 5, 17, 30, 9])
    local = [10, 0, 1, 2, 31, 12]
    handle = asyncio.run(handshake_and_pull(reader, reader.dest.compat, source.endpoint, "tcp",
                                            plan_for(blocks, local)))
    assert handle.state is TransferState.DONE, handle.error
    assert_blocks_copied(reader.dest.kv, reader.dest.before, source.kv, handle.plan)
    assert source.active() == 0 and handle.lease_ended
    assert set(blocks.block_ids) <= set(source.freed())


def test_a_release_that_does_not_get_through_leaves_the_lease_unended() -> None:
    """The pull's Release goes to a source that no longer answers: the read's bytes
    stand (a tcp read checks the lease itself) but lease_ended stays False, so the
    caller knows the lease is still the source's to end (the router aborts it)."""
    class Done:
        confirms_lease = True

        def start_read(self, peer, plan):
            h = ReadHandle(peer, plan, 0)
            h.finish(TransferState.DONE)
            return h

        def poll(self, handle):
            return handle.state

    async def body():
        client = KVLinkClient(f"127.0.0.1:{free_port()}", "test-reader", TEST_SECRET,
                              rpc_timeout_s=2.0)
        try:
            return await client.pull(Done(), None, ReadPlan("r", 1, (0,), (1,)), timeout_s=5)
        finally:
            await client.close()
    handle = asyncio.run(body())
    assert handle.state is TransferState.DONE and not handle.lease_ended


def test_parallel_reads_and_second_read_of_a_lease(source: SourceProcess, reader) -> None:
    peer, _ = connect(reader, source)
    a, b = source.grant("ra", [0, 1, 2, 3]), source.grant("rb", [20, 21])
    plans = [ReadPlan.from_source(a, [4, 5, 6, 7]), ReadPlan.from_source(b, [8, 9]),
             ReadPlan.from_source(a, [16, 17], skip=2)]
    handles = [reader.start_read(peer, p) for p in plans]
    assert [reader.wait(h, 20) for h in handles] == [TransferState.DONE] * 3
    for p in plans:
        for rb, lb in zip(p.remote_block_ids, p.local_block_ids):
            assert torch.equal(reader.dest.kv[lb], source.kv[rb])
    assert asyncio.run(release(source.endpoint, "ra", a.epoch, a.lease_token)) == (True, ReleaseReason.RELEASED)
    assert asyncio.run(release(source.endpoint, "ra", a.epoch, a.lease_token)) == (False, ReleaseReason.DUPLICATE)
    assert asyncio.run(release(source.endpoint, "rb", b.epoch, b.lease_token)) == (True, ReleaseReason.RELEASED)


def test_a_disconnected_peer_leaves_nothing_and_can_come_back(source: SourceProcess,
                                                              reader) -> None:
    """A read in flight when its source is disconnected (or connected again) ends on the
    address it started with; then the reader holds nothing for that source."""
    peer, info = connect(reader, source)
    blocks = source.grant("dc", [7, 8])
    handle = reader.start_read(peer, ReadPlan.from_source(blocks, [2, 3]))
    assert reader.connect(info) == peer  # a fresh handshake replaces the state...
    reader.disconnect(peer)  # ...and the source leaves, both maybe mid-read
    assert reader.wait(handle, 20) is TransferState.DONE, handle.error
    assert_blocks_copied(reader.dest.kv, reader.dest.before, source.kv, handle.plan)
    assert reader.num_peers() == 0 and reader.in_flight() == 0
    with pytest.raises(KeyError, match="disconnected"):
        reader.start_read(peer, ReadPlan.from_source(blocks, [2, 3]))
    assert reader.connect(info) == peer and reader.num_peers() == 1
    assert asyncio.run(release(source.endpoint, "dc", blocks.epoch, blocks.lease_token)) \
        == (True, ReleaseReason.RELEASED)


def test_compat_mismatch_fails_at_connect(source: SourceProcess) -> None:
    assert_compat_mismatch_fails_at_connect(source)


def test_expired_lease_read_fails(source: SourceProcess, reader) -> None:
    peer, _ = connect(reader, source)
    blocks = source.grant("old", [6, 7], ttl_s=0.2)
    time.sleep(0.3)
    handle = reader.start_read(peer, ReadPlan.from_source(blocks, [0, 1]))
    assert reader.wait(handle, 20) is TransferState.EXPIRED
    assert isinstance(handle.error, LeaseError) and "expired" in str(handle.error)
    assert torch.equal(reader.dest.kv, reader.dest.before), "bytes of an expired lease landed"
    handle = asyncio.run(handshake_and_pull(reader, reader.dest.compat, source.endpoint, "tcp",
                                            plan_for(blocks, [0, 1])))
    assert handle.state is TransferState.EXPIRED  # the Release also reaped it
    assert source.active() == 0 and {6, 7} <= set(source.freed())


def _raw_request(source: SourceProcess, info: SourceInfo, payload: bytes) -> pb.ReadHeader:
    with socket.create_connection((info.data_host, info.data_port), timeout=10) as sock:
        sock.sendall(payload)
        return recv_frame(sock, pb.ReadHeader)


def _frame(msg: pb.ReadRequest) -> bytes:
    body = msg.SerializeToString()
    return struct.pack(">I", len(body)) + body


def test_malformed_requests_refused_and_server_survives(source: SourceProcess, reader) -> None:
    peer, info = connect(reader, source)
    blocks = source.grant("m", [1, 2])
    bb, epoch = info.block_bytes, blocks.epoch
    cases = [
        (struct.pack(">I", 1 << 30), "exceeds"),
        (struct.pack(">I", 3) + b"\xff\xff\xff", "unparsable"),
        (_frame(pb.ReadRequest(request_id="m", epoch=epoch, block_ids=[1], block_bytes=bb + 1)),
         "block_bytes"),
        (_frame(pb.ReadRequest(request_id="m", epoch=epoch, block_ids=[1, 999], block_bytes=bb)),
         "out of range"),
        (_frame(pb.ReadRequest(request_id="m", epoch=epoch, block_ids=[], block_bytes=bb)),
         "no block ids"),
    ]
    for payload, reason in cases:
        header = _raw_request(source, info, payload)
        assert header.status == pb.READ_MALFORMED and reason in header.error, header
    header = _raw_request(source, info, _frame(pb.ReadRequest(
        request_id="m", epoch=epoch, block_ids=[3], block_bytes=bb,
        lease_token=blocks.lease_token)))
    assert header.status == pb.READ_LEASE and "does not cover" in header.error
    for token in ("", "f" * 32):  # a guessed token reads nothing
        header = _raw_request(source, info, _frame(pb.ReadRequest(
            request_id="m", epoch=epoch, block_ids=[1], block_bytes=bb, lease_token=token)))
        assert header.status == pb.READ_LEASE and "wrong lease token" in header.error
    # Reader-side checks: nothing is sent for a plan outside either cache.
    with pytest.raises(ValueError, match="remote block id 32"):
        reader.start_read(peer, ReadPlan("m", epoch, (1, 32), (0, 1)))
    with pytest.raises(ValueError, match="local block id 40"):
        reader.start_read(peer, ReadPlan("m", epoch, (1,), (40,)))
    handle = reader.start_read(peer, ReadPlan.from_source(blocks, [30, 31]))  # still serving
    assert reader.wait(handle, 20) is TransferState.DONE, handle.error
    assert asyncio.run(release(source.endpoint, "m", epoch, blocks.lease_token)) == (True, ReleaseReason.RELEASED)


def test_reader_vanishing_mid_stream_does_not_hurt_source(source: SourceProcess, reader) -> None:
    peer, info = connect(reader, source)
    blocks = source.grant("v", list(range(32)))
    with socket.create_connection((info.data_host, info.data_port), timeout=10) as sock:
        send_frame(sock, pb.ReadRequest(request_id="v", epoch=blocks.epoch,
                                        block_ids=list(range(32)), block_bytes=info.block_bytes,
                                        lease_token=blocks.lease_token))
        assert recv_frame(sock, pb.ReadHeader).status == pb.READ_OK
        sock.recv(1000)  # take a little, then hang up mid-stream
    handle = reader.start_read(peer, ReadPlan.from_source(blocks, list(range(31, -1, -1))))
    assert reader.wait(handle, 20) is TransferState.DONE, handle.error
    assert asyncio.run(release(source.endpoint, "v", blocks.epoch, blocks.lease_token)) == (True, ReleaseReason.RELEASED)


def test_source_killed_mid_transfer_fails_the_read(source: SourceProcess, reader) -> None:
    block_bytes = reader.dest.compat.block_bytes
    proc, port = start_dying_source(block_bytes)
    try:
        info = SourceInfo("dying", "tcp", reader.dest.compat, 32, block_bytes,
                          data_host="127.0.0.1", data_port=port)
        peer = reader.connect(info)
        handle = reader.start_read(peer, ReadPlan("r", 1, (0, 1, 2, 3), (4, 5, 6, 7)))
        assert reader.wait(handle, 20) is TransferState.FAILED
        assert "peer closed" in str(handle.error) or "reset" in str(handle.error).lower()
        assert reader.in_flight() == 0
        # The dead peer no longer accepts: a new read fails cleanly too.
        proc.join(10)
        handle = reader.start_read(peer, ReadPlan("r", 1, (0,), (4,)))
        assert reader.wait(handle, 20) is TransferState.FAILED
    finally:
        proc.kill()
        proc.join(10)
