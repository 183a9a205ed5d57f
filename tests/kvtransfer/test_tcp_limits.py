"""The TCP data path under pressure: aborting a read never blocks the caller (the
event loop), connections beyond a cap are refused at once, and a connection thread
that cannot start costs that read only, never the accept loop."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvtransfer.base import CompatRecord, ReadPlan, SourceInfo, TransferState
from kvtransfer.tcp import TcpReader, TcpSource, recv_frame, send_frame
from proto import kv_link_pb2 as pb

SHAPE = (8, 2, 2, 4, 2, 8)  # [blocks, layers, 2, block_size, kv heads, head dim]


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _compat(kv: torch.Tensor) -> CompatRecord:
    return CompatRecord.from_kv(kv, "test-fingerprint")


@pytest.fixture
def source():
    kv = _kv(1)
    src = TcpSource(max_connections=2)
    src.register(kv, _compat(kv), lambda rid, epoch, token, ids: None)
    src.serve("127.0.0.1")
    yield src, kv
    src.close()


def _reader(port: int, host: str = "127.0.0.1", **kw) -> tuple[TcpReader, object, torch.Tensor]:
    kv = torch.zeros(SHAPE)
    rd = TcpReader(**kw)
    rd.register(kv, _compat(kv))
    info = SourceInfo("src", "tcp", _compat(kv), SHAPE[0], kv[0].numel() * 4,
                      data_host=host, data_port=port)
    return rd, rd.connect(info), kv


def _wait(rd: TcpReader, handle, timeout_s: float) -> TransferState:
    deadline = time.monotonic() + timeout_s
    while rd.poll(handle) is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    return handle.state


def test_abort_returns_at_once_while_connect_hangs() -> None:
    """Finding 11: TcpReader.abort waited up to 5 s for a read still connecting, on the
    decode worker's event loop."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue: later SYNs are dropped, connect hangs
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.1)
    rd, peer, _ = _reader(port, connect_timeout_s=3.0)
    handle = rd.start_read(peer, ReadPlan("r", 1, [0], [0]))
    time.sleep(0.2)
    t0 = time.monotonic()
    rd.abort(handle)
    assert time.monotonic() - t0 < 0.5
    assert _wait(rd, handle, 10) is TransferState.FAILED
    assert rd.in_flight() == 0
    rd.close()
    for s in fillers + [srv]:
        s.close()


def test_connections_beyond_the_cap_are_refused(source) -> None:
    src, kv = source
    port = src.handshake_info("src").data_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # hold both slots
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        send_frame(s, pb.ReadRequest(request_id="r", epoch=1, block_ids=[0],
                                     block_bytes=kv[0].numel() * 4))
        header = recv_frame(s, pb.ReadHeader)
    assert header.status == pb.READ_INTERNAL and "busy" in header.error
    for s in idle:
        s.close()
    time.sleep(0.2)
    rd, peer, dst = _reader(port)  # slots back: reads work again
    handle = rd.start_read(peer, ReadPlan("r", 1, [3], [5]))
    assert _wait(rd, handle, 10) is TransferState.DONE, handle.error
    assert torch.equal(dst[5], kv[3])
    rd.close()


def test_a_thread_that_cannot_start_costs_one_read_not_the_server(source, monkeypatch) -> None:
    """Finding 11: a failed thread start raised out of the accept loop and the source
    stopped accepting for good."""
    src, kv = source
    port = src.handshake_info("src").data_port
    real_start, failed = threading.Thread.start, []

    def start(self):
        if self.name == "kv-tcp-conn" and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread (injected)")
        return real_start(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    rd, peer, dst = _reader(port)
    first = rd.start_read(peer, ReadPlan("r", 1, [2], [2]))
    assert _wait(rd, first, 10) is TransferState.FAILED
    second = rd.start_read(peer, ReadPlan("r", 1, [4], [6]))
    assert _wait(rd, second, 10) is TransferState.DONE, second.error
    assert torch.equal(dst[6], kv[4]) and failed
    rd.close()
