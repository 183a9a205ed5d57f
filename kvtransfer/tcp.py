"""Plain TCP backend: the fallback data path when NIXL is not installed.

One connection per read. The reader sends a length-prefixed ``ReadRequest``;
the source answers with a ``ReadHeader``, then (when READ_OK) the blocks'
raw bytes in request order, then a ``ReadTrailer`` (proto/kv_link.proto).
Frames are ``[u32 big-endian length][protobuf]``; block bytes go straight
from the source tensor to the socket and from the socket into the reader's
tensor (no pickles, no intermediate copies on CPU; CUDA tensors are staged
through host memory).

The source checks the lease before the header and again before the trailer,
so a lease that expired while bytes were streaming turns into READ_LEASE, not
stale data. It refuses malformed requests (unparsable frame, wrong
block_bytes, out-of-range ids) with an error header and closes that
connection; it never lets one connection take the server down.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError, Message

from kvtransfer.base import (Backend, CompatRecord, KVReader, KVTransferError, LeaseError, PeerId,
                             ReadHandle, ReadPlan, SourceInfo, TransferState,
                             contiguous_runs)
from kvtransfer.copy_source import CopySource
from kvtransfer.group_kv import GroupKV, registered
from kvtransfer.in_flight import InFlightReads
from proto import kv_link_pb2 as pb

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20
"""Largest control frame accepted; a ReadRequest for 100k blocks is ~500 KB."""
_SOCK_BUF = 4 << 20

M = TypeVar("M", bound=Message)


class FrameError(KVTransferError):
    """A control frame was too large or did not parse."""


def send_frame(sock: socket.socket, msg: Message) -> None:
    body = msg.SerializeToString()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {want} bytes")
        got += n


def recv_frame(sock: socket.socket, msg_type: type[M]) -> M:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    msg = msg_type()
    try:
        msg.ParseFromString(bytes(body))
    except DecodeError as e:
        raise FrameError(f"unparsable {msg_type.__name__}: {e}") from e
    return msg


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def _flat(blocks: torch.Tensor) -> memoryview:
    """A 1-D byte view of CPU ``blocks`` ([n, block_bytes] uint8), sharing memory."""
    return memoryview(blocks.numpy().reshape(-1))


class TcpSource(CopySource):
    """Threads: one accept thread plus one daemon thread per open connection, at most
    ``max_connections`` of them; a connection beyond that is refused at once
    (READ_INTERNAL, "busy"), so the reader recomputes instead of the source running
    out of threads. A thread that cannot start costs that one connection, never the
    accept loop."""

    name = "tcp"

    def __init__(self, io_timeout_s: float = 30.0, advertise_host: str | None = None,
                 max_connections: int = 64) -> None:
        """``advertise_host``: the address readers should dial when ``serve``
        binds a wildcard (0.0.0.0 in a pod: pass the pod IP); default: the
        bound host."""
        super().__init__()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._io_timeout_s = io_timeout_s
        self._advertise_host = advertise_host
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._closed = False

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._require_registered("serve")
        self._listener = socket.create_server((host, port), backlog=128)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept",
                                               daemon=True)
        self._accept_thread.start()

    def handshake_info(self, worker_id: str) -> SourceInfo:
        assert self._compat is not None and self._listener
        host, port = self._listener.getsockname()[:2]
        return SourceInfo(worker_id, "tcp", self._compat, *self._shape,
                          data_host=self._advertise_host or host,
                          data_port=port)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = list(self._conns), set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, pb.READ_INTERNAL, f"source busy: {self._max_connections} "
                                                     "reads in progress")
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), name="kv-tcp-conn",
                                 daemon=True).start()
            except Exception:  # noqa: BLE001 - e.g. no thread left: lose one read, not the loop
                log.exception("kv tcp source could not start a connection thread")
                self._forget(conn)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()
        self._slots.release()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            _tune(conn)
            conn.settimeout(self._io_timeout_s)
            request = recv_frame(conn, pb.ReadRequest)
            self._serve_one(conn, request)
        except FrameError as e:
            self._refuse(conn, pb.READ_MALFORMED, str(e))
        except OSError as e:
            log.debug("kv tcp connection dropped: %s", e)  # reader gone; nothing held
        except Exception:  # a bug mid-stream: close, the reader sees a short read
            log.exception("kv tcp source failed serving a read")
        finally:
            self._forget(conn)

    def _refuse(self, conn: socket.socket, status: int, error: str) -> None:
        try:
            send_frame(conn, pb.ReadHeader(status=status, error=error))
        except OSError:
            pass

    def _validate(self, req: pb.ReadRequest) -> tuple[int, str] | None:
        """(status, reason) when ``req`` must be refused, else None."""
        assert self._lease_check is not None
        num_blocks, block_bytes = self._shape
        if req.block_bytes != block_bytes:
            return (pb.READ_MALFORMED,
                    f"block_bytes: request {req.block_bytes} != source {block_bytes}")
        if not req.block_ids:
            return pb.READ_MALFORMED, "no block ids"
        bad = [b for b in req.block_ids if b >= num_blocks]
        if bad:
            return pb.READ_MALFORMED, f"block id {bad[0]} out of range (source has {num_blocks})"
        return self._check_lease(req)

    def _check_lease(self, req: pb.ReadRequest) -> tuple[int, str] | None:
        assert self._lease_check is not None
        try:
            self._lease_check(req.request_id, req.epoch, req.lease_token, list(req.block_ids))
        except LeaseError as e:
            return pb.READ_LEASE, str(e)
        except Exception as e:  # a broken callback must not look like a live lease
            log.exception("kv lease check failed")
            return pb.READ_INTERNAL, f"lease check failed: {type(e).__name__}: {e}"
        return None

    def _serve_one(self, conn: socket.socket, req: pb.ReadRequest) -> None:
        refusal = self._validate(req)
        if refusal is not None:
            self._refuse(conn, *refusal)
            return
        send_frame(conn, pb.ReadHeader(status=pb.READ_OK, num_blocks=len(req.block_ids),
                                       block_bytes=self._shape[1]))
        for piece in self._pieces(req.block_ids):
            conn.sendall(_flat(piece))
        refusal = self._check_lease(req)  # bytes sent while the lease was gone are stale
        status, error = refusal if refusal is not None else (pb.READ_OK, "")
        send_frame(conn, pb.ReadTrailer(status=status, error=error))


@dataclass(frozen=True)
class _Address:
    """Where a source serves reads (a TcpReader's per-peer state)."""

    host: str
    port: int
    num_blocks: int


@dataclass
class _TcpRead:
    """Backend state of one read (ReadHandle.impl)."""

    future: cf.Future[None] | None = None
    sock: socket.socket | None = None
    cancelled: bool = False


class TcpReader(KVReader):
    """Reads run on a small thread pool (``max_parallel_reads``), one connection each."""

    name = "tcp"
    confirms_lease = True

    def __init__(self, max_parallel_reads: int = 4, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 30.0) -> None:
        super().__init__()
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._pool = cf.ThreadPoolExecutor(max_parallel_reads, thread_name_prefix="kv-tcp-read")
        self._blocks: torch.Tensor | None = None
        self._group: GroupKV | None = None
        """Registered instead of a tensor by rank 0 of a tensor-parallel group."""
        self._shape: tuple[int, int] = (0, 0)
        self._compat: CompatRecord | None = None
        self._reads: InFlightReads[_Address] = InFlightReads(self._peers)
        """A read is ended by its pool thread, or by ``abort`` when it never started."""

    def register(self, kv: torch.Tensor | GroupKV, compat: CompatRecord) -> None:
        self._blocks, self._group, self._shape = registered(kv, compat)
        self._compat = compat

    def connect(self, info: SourceInfo) -> PeerId:
        assert self._compat is not None, "register before connect"
        info.check_reader(self._compat, "tcp", reachable=bool(info.data_port))
        peer = PeerId(info.worker_id)
        with self._lock:
            self._peers.set(peer, _Address(info.data_host, info.data_port, info.num_blocks))
        return peer

    def start_read(self, peer: PeerId, plan: ReadPlan) -> ReadHandle:
        assert self._compat is not None, "register before start_read"
        with self._lock:
            address = self._peers[peer]
            plan.check_bounds(address.num_blocks, self._shape[0])
            handle = self._reads.start(peer, plan, self._shape[1], impl=_TcpRead())
        handle.impl.future = self._pool.submit(self._run, handle, address.host, address.port)
        return handle

    def poll(self, handle: ReadHandle) -> TransferState:
        return handle.state

    def wait(self, handle: ReadHandle, timeout_s: float) -> TransferState:
        if handle.impl is not None and handle.impl.future is not None:
            cf.wait([handle.impl.future], timeout=timeout_s)
        return handle.state

    def abort(self, handle: ReadHandle) -> None:
        """Returns at once (it runs on the event loop): a read not started yet ends
        FAILED now; a running one is cut off (its socket shut down) and its thread
        ends it FAILED as soon as the socket lets go."""
        read: _TcpRead = handle.impl
        with self._lock:
            if handle.state.terminal:
                return
            read.cancelled = True
            sock = read.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks the worker's recv
            except OSError:
                pass
        if read.future is not None and read.future.cancel():
            self._end(handle, TransferState.FAILED, KVTransferError("read aborted"))

    def close(self) -> None:
        with self._lock:
            pending = self._reads.pending()
        for handle in pending:
            self.abort(handle)
        self._pool.shutdown(wait=True)  # the aborted reads' threads end them
        with self._lock:
            self._peers.clear()

    def _end(self, handle: ReadHandle, state: TransferState, error: Exception | None = None) -> None:
        with self._lock:
            self._reads.end(handle, state, error)  # a no-op when abort got there first

    def _run(self, handle: ReadHandle, host: str, port: int) -> None:
        """Pool thread: the whole read; always ends the handle."""
        read: _TcpRead = handle.impl
        state, error = TransferState.FAILED, None
        try:
            with socket.create_connection((host, port), timeout=self._connect_timeout_s) as sock:
                with self._lock:
                    read.sock = sock
                    if read.cancelled:
                        raise KVTransferError("aborted before it started")
                _tune(sock)
                sock.settimeout(self._io_timeout_s)
                state, error = self._exchange(sock, handle.plan)
        except (OSError, KVTransferError) as e:
            error = KVTransferError(f"tcp read from {handle.peer} ({host}:{port}) failed: {e}")
        except Exception as e:  # report it; never leave a handle PENDING
            error = e
        if read.cancelled:
            state, error = TransferState.FAILED, KVTransferError("read aborted")
        self._end(handle, state, error)

    def _exchange(self, sock: socket.socket, plan: ReadPlan) -> tuple[TransferState, Exception | None]:
        block_bytes = self._shape[1]
        send_frame(sock, pb.ReadRequest(request_id=plan.request_id, epoch=plan.epoch,
                                        block_ids=plan.remote_block_ids, block_bytes=block_bytes,
                                        lease_token=plan.lease_token))
        header = recv_frame(sock, pb.ReadHeader)
        if header.status != pb.READ_OK:
            return _refused(header.status, header.error)
        if header.num_blocks != plan.num_blocks or header.block_bytes != block_bytes:
            return TransferState.FAILED, KVTransferError(
                f"source announced {header.num_blocks} x {header.block_bytes} B, "
                f"expected {plan.num_blocks} x {block_bytes} B")
        staged = self._receive(sock, plan)
        trailer = recv_frame(sock, pb.ReadTrailer)
        if trailer.status != pb.READ_OK:
            return _refused(trailer.status, trailer.error)
        if staged is not None:  # confirmed: now each rank of the group takes its heads
            self._group.write(plan.local_block_ids, staged)
        return TransferState.DONE, None

    def _receive(self, sock: socket.socket, plan: ReadPlan) -> torch.Tensor | None:
        """The blocks' bytes, straight into the tensor's blocks (None), or, for a
        group, into a staging tensor returned for the scatter."""
        if self._group is not None:
            staged = torch.empty(plan.num_blocks, self._shape[1], dtype=torch.uint8)
            recv_exact(sock, _flat(staged))
            return staged
        for _, first, n in contiguous_runs(plan.local_block_ids):
            dst = self._blocks[first:first + n]
            if dst.device.type == "cpu":
                recv_exact(sock, _flat(dst))
            else:
                staging = torch.empty(dst.shape, dtype=torch.uint8)
                recv_exact(sock, _flat(staging))
                dst.copy_(staging)
        return None


def _refused(status: int, error: str) -> tuple[TransferState, Exception]:
    if status == pb.READ_LEASE:
        return TransferState.EXPIRED, LeaseError(error)
    name = pb.ReadStatus.Name(status) if status in pb.ReadStatus.values() else str(status)
    return TransferState.FAILED, KVTransferError(f"source refused the read ({name}): {error}")


BACKEND = Backend("tcp", TcpSource, TcpReader)
