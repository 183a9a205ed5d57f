"""InFlightReads: every read ends once, whoever ends it, and lets go of its peer state then;
and a reader closed while a read is in flight ends that read and holds nothing after."""
from __future__ import annotations

import socket

import pytest
import torch

from kvtransfer.base import (CompatRecord, KVTransferError, PeerId, ReadHandle, ReadPlan, SourceInfo,
                             TransferState)
from kvtransfer.in_flight import InFlightReads
from kvtransfer.peer_table import PeerTable
from kvtransfer.tcp import TcpReader

A = PeerId("prefill-a")
PLAN = ReadPlan("r", 1, (0, 1), (2, 3))


def test_a_read_ends_once_and_then_lets_go_of_its_peer_state() -> None:
    released: list[str] = []
    peers: PeerTable[str] = PeerTable(released.append)
    reads: InFlightReads[str] = InFlightReads(peers)
    peers.set(A, "agent-1")
    first, second = reads.start(A, PLAN, block_bytes=100), reads.start(A, PLAN, block_bytes=100)
    assert first.nbytes == 200 and first.state is TransferState.PENDING and len(reads) == 2
    peers.set(A, "agent-2")  # a re-handshake while both reads use agent-1
    assert reads.peer_state(first) == "agent-1" and reads.pending() == [first, second]
    aborted = KVTransferError("read aborted")
    assert reads.end(first, TransferState.FAILED, aborted)
    assert not reads.end(first, TransferState.DONE)  # the read's own end, after the abort
    assert first.state is TransferState.FAILED and first.error is aborted
    assert released == [] and len(reads) == 1  # the other read still uses agent-1
    assert reads.end(second, TransferState.DONE) and second.error is None
    assert released == ["agent-1"] and len(reads) == 0 and len(peers) == 1
    peers.drop(A)
    assert released == ["agent-1", "agent-2"] and len(peers) == 0


def test_a_read_whose_transport_cannot_let_go_fails_and_keeps_its_peer_state() -> None:
    released: list[str] = []
    freed: list[ReadHandle] = []
    stuck = KVTransferError("could not release the read")

    def free_read(handle: ReadHandle) -> Exception | None:
        freed.append(handle)
        return stuck if handle.impl == "stuck" else None

    peers: PeerTable[str] = PeerTable(released.append)
    reads: InFlightReads[str] = InFlightReads(peers, free_read)
    peers.set(A, "agent")
    ok, bad = reads.start(A, PLAN, 10, impl="ok"), reads.start(A, PLAN, 10, impl="stuck")
    assert reads.end(ok, TransferState.DONE) and ok.state is TransferState.DONE
    assert reads.end(bad, TransferState.DONE)
    assert bad.state is TransferState.FAILED and bad.error is stuck
    assert not reads.end(bad, TransferState.FAILED) and freed == [ok, bad]  # freed once each
    peers.drop(A)
    assert len(reads) == 0 and released == [] and len(peers) == 1  # still pinned by ``bad``


def test_an_unknown_peer_records_nothing() -> None:
    reads: InFlightReads[str] = InFlightReads(PeerTable())
    with pytest.raises(KeyError, match="prefill-a"):
        reads.start(A, PLAN, 10)
    assert len(reads) == 0


def test_close_with_a_read_in_flight_ends_it_and_holds_nothing() -> None:
    """The source accepts the read and never answers: close cuts the read (its socket is
    shut down), the read's thread ends it FAILED, and the reader holds no read and no peer."""
    kv = torch.zeros(4, 1, 2, 2, 1, 4)
    compat = CompatRecord.from_kv(kv, "test-fingerprint")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        reader = TcpReader(io_timeout_s=60.0)
        reader.register(kv, compat)
        peer = reader.connect(SourceInfo("src", "tcp", compat, 4, compat.block_bytes,
                                         data_host="127.0.0.1",
                                         data_port=silent.getsockname()[1]))
        handle = reader.start_read(peer, PLAN)
        conn, _ = silent.accept()  # the read is connected and waits for a header
        with conn:
            assert reader.in_flight() == 1 and reader.num_peers() == 1
            reader.close()
            assert handle.state is TransferState.FAILED and "aborted" in str(handle.error)
            assert reader.in_flight() == 0 and reader.num_peers() == 0
            assert torch.equal(kv, torch.zeros_like(kv))
