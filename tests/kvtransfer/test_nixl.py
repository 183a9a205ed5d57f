"""NIXL backend (UCX; CMA between two processes of this host) across two processes."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="nixl_cu12 is not installed (pip install nixl-cu12)")

from kvtransfer.base import (KVTransferError, LeaseError, ReadPlan,  # noqa: E402
                             TransferState, get_backend)
from kvtransfer.lease import ReleaseReason  # noqa: E402
from tests.kvtransfer.utils import (Dest, SourceProcess, assert_blocks_copied,  # noqa: E402
                                    assert_compat_mismatch_fails_at_connect, handshake,
                                    handshake_and_pull, plan_for, release)

BACKEND, SOURCE_SEED = "nixl", 21
"""What the ``source`` and ``reader`` fixtures (conftest.py) serve and read with."""


def test_read_subset_cross_process(source: SourceProcess, reader) -> None:
    blocks = source.grant("r1", [3, 4, 5, 17, 30, 9])
    handle = asyncio.run(handshake_and_pull(reader, reader.dest.compat, source.endpoint, "nixl",
                                            plan_for(blocks, [10, 0, 1, 2, 31, 12])))
    assert handle.state is TransferState.DONE, handle.error
    assert_blocks_copied(reader.dest.kv, reader.dest.before, source.kv, handle.plan)
    assert set(blocks.block_ids) <= set(source.freed())
    # Reconnecting to the same source is idempotent; a second lease reads fine.
    blocks = source.grant("r2", list(range(32)))
    handle = asyncio.run(handshake_and_pull(reader, reader.dest.compat, source.endpoint, "nixl",
                                            plan_for(blocks, list(range(31, -1, -1)))))
    assert handle.state is TransferState.DONE, handle.error
    assert_blocks_copied(reader.dest.kv, reader.dest.before, source.kv, handle.plan)


def test_compat_mismatch_fails_at_connect(source: SourceProcess) -> None:
    assert_compat_mismatch_fails_at_connect(source)


def test_expired_lease_read_fails(source: SourceProcess, reader) -> None:
    blocks = source.grant("old", [6, 7], ttl_s=0.2)
    time.sleep(0.3)
    handle = asyncio.run(handshake_and_pull(reader, reader.dest.compat, source.endpoint, "nixl",
                                            plan_for(blocks, [0, 1])))
    # The one-sided READ itself cannot see the lease; the Release reply can.
    assert handle.state is TransferState.EXPIRED
    assert isinstance(handle.error, LeaseError) and "expired" in str(handle.error)
    assert source.active() == 0 and {6, 7} <= set(source.freed())


def test_malformed_descriptors_and_ids_rejected(source: SourceProcess, reader) -> None:
    info = asyncio.run(handshake(reader.dest.compat, source.endpoint, "nixl"))
    for forged in (dataclasses.replace(info, num_blocks=info.num_blocks + 1),
                   dataclasses.replace(info, base_addr=info.base_addr + 4096)):
        with pytest.raises(KVTransferError, match="rejected the descriptors"):
            reader.connect(forged)  # outside the source's registered region
    peer = reader.connect(info)
    blocks = source.grant("m", [1, 2])
    with pytest.raises(ValueError, match="remote block id 32"):
        reader.start_read(peer, ReadPlan("m", blocks.epoch, (1, 32), (0, 1)))
    with pytest.raises(ValueError, match="local block id 40"):
        reader.start_read(peer, ReadPlan("m", blocks.epoch, (1,), (40,)))
    assert torch.equal(reader.dest.kv, reader.dest.before)
    handle = reader.start_read(peer, ReadPlan.from_source(blocks, [30, 31]))
    assert reader.wait(handle, 20) is TransferState.DONE, handle.error
    assert asyncio.run(release(source.endpoint, "m", blocks.epoch, blocks.lease_token)) == (True, ReleaseReason.RELEASED)


def test_source_killed_fails_the_read() -> None:
    with SourceProcess("nixl", torch.float32, seed=5) as src:
        dest = Dest.make(torch.float32)
        rd = get_backend("nixl").reader()
        rd.register(dest.kv, dest.compat)
        try:
            info = asyncio.run(handshake(dest.compat, src.endpoint, "nixl"))
            peer = rd.connect(info)
            blocks = src.grant("k", [0, 1])
            handle = rd.start_read(peer, ReadPlan.from_source(blocks, [0, 1]))
            assert rd.wait(handle, 20) is TransferState.DONE, handle.error
            src.kill()
            handle = rd.start_read(peer, ReadPlan("k", blocks.epoch, tuple(range(32)),
                                                  tuple(range(32))))
            assert rd.wait(handle, 20) is TransferState.FAILED
            assert isinstance(handle.error, KVTransferError)
            assert rd.in_flight() == 0
        finally:
            rd.close()


def test_a_re_handshake_mid_read_lets_the_read_end_on_the_old_agent() -> None:
    """A source restarted (same worker id, new NIXL agent) and the reader handshakes again
    while a READ from the old agent is in flight: that connect used to free the old agent's
    descriptors and the agent itself under the READ (NIXL then failed it with
    NIXL_ERR_NOT_FOUND). Now the READ ends on the old agent with the right bytes, the old
    state is released once it ended, and new reads go to the new agent."""
    with SourceProcess("nixl", torch.float32, seed=41) as old, \
            SourceProcess("nixl", torch.float32, seed=41) as new:  # same id and bytes
        dest = Dest.make(torch.float32)
        rd = get_backend("nixl").reader()
        rd.register(dest.kv, dest.compat)
        try:
            info_old = asyncio.run(handshake(dest.compat, old.endpoint, "nixl"))
            info_new = asyncio.run(handshake(dest.compat, new.endpoint, "nixl"))
            assert info_old.worker_id == info_new.worker_id
            assert info_old.agent_name != info_new.agent_name
            blocks = old.grant("mid", list(range(32)))
            old.call("pause")  # the old source stops progressing: the READ's wire-up waits
            try:
                peer = rd.connect(info_old)
                handle = rd.start_read(peer, ReadPlan.from_source(blocks, list(range(31, -1, -1))))
                assert rd.poll(handle) is TransferState.PENDING, "the read was not in flight"
                assert rd.connect(info_new) == peer  # the re-handshake, mid-read
            finally:
                old.call("resume")
            assert rd.wait(handle, 20) is TransferState.DONE, handle.error
            assert_blocks_copied(dest.kv, dest.before, old.kv, handle.plan)
            assert rd.num_peers() == 1 and rd.in_flight() == 0  # the old agent is gone
            assert asyncio.run(release(old.endpoint, "mid", blocks.epoch, blocks.lease_token)) \
                == (True, ReleaseReason.RELEASED)
            after = new.grant("after", [4, 5])
            before = dest.kv.clone()
            handle = rd.start_read(peer, ReadPlan.from_source(after, [0, 1]))
            assert rd.wait(handle, 20) is TransferState.DONE, handle.error
            assert_blocks_copied(dest.kv, before, new.kv, handle.plan)
            assert asyncio.run(release(new.endpoint, "after", after.epoch, after.lease_token)) \
                == (True, ReleaseReason.RELEASED)
            rd.disconnect(peer)  # the source left: nothing of it stays
            assert rd.num_peers() == 0 and rd.in_flight() == 0
            with pytest.raises(KeyError, match="disconnected"):
                rd.start_read(peer, ReadPlan.from_source(after, [0, 1]))
        finally:
            rd.close()
        assert old.active() == 0 and new.active() == 0, "leak: a lease outlived the test"
