"""The KVLink control path over gRPC (grpc.aio): handshake and release.

Source side: ``KVLinkServicer`` answers Handshake from its KVSource and Release
from its LeaseTable, calling ``lease_ended`` with each lease exactly once (on
release, or when ``reap_expired`` finds it expired): the owner frees its blocks. Destination
side: ``KVLinkClient`` does the handshake and release, and ``pull`` runs the
whole handoff for one request: start the read, poll it, always send Release,
and, for one-sided reads (nixl), trust the bytes only if Release says the
lease was live (base.py, ``KVReader.confirms_lease``).

The converters between the dataclasses of base.py and proto messages live here
too, so no other module needs to know the wire format of this link.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Callable

import grpc

from kvtransfer.base import (CompatRecord, KVAuthError, KVCompatError, KVReader, KVSource, KVTransferError,
                             LeaseError, PeerId, ReadHandle, ReadPlan, SourceBlocks, SourceInfo,
                             TransferState, poll_pauses)
from auth.grpc_auth import channel as auth_channel
from auth.tokens import proof
from proto.convert import WireEnum
from kvtransfer.lease import Lease, LeaseTable, ReleaseReason
from proto import kv_link_pb2 as pb
from proto import kv_link_pb2_grpc as pb_grpc
from tracing.rpc import client_interceptors

log = logging.getLogger(__name__)

LeaseEnded = Callable[[Lease], None]
"""Called once per lease that ended (released or expired): free its blocks."""


def compat_to_proto(c: CompatRecord) -> pb.CompatRecord:
    return pb.CompatRecord(model_fingerprint=c.model_fingerprint, dtype=c.dtype,
                           block_size=c.block_size, num_layers=c.num_layers,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, kv_layout=c.kv_layout,
                           kv_cache_dtype=c.kv_cache_dtype, kv_scale_layout=c.kv_scale_layout,
                           tensor_parallel_size=c.tensor_parallel_size,
                           rank_kv_heads=c.rank_kv_heads)


def compat_from_proto(m: pb.CompatRecord) -> CompatRecord:
    return CompatRecord(m.model_fingerprint, m.dtype, m.block_size, m.num_layers,
                        m.num_kv_heads, m.head_dim, m.kv_layout, m.kv_cache_dtype,
                        m.kv_scale_layout, m.tensor_parallel_size, tuple(m.rank_kv_heads))


def info_to_proto(i: SourceInfo) -> pb.HandshakeReply:
    return pb.HandshakeReply(compat=compat_to_proto(i.compat), backend=i.backend,
                             worker_id=i.worker_id, agent_name=i.agent_name,
                             agent_metadata=i.agent_metadata, base_addr=i.base_addr,
                             block_bytes=i.block_bytes, num_blocks=i.num_blocks,
                             data_host=i.data_host, data_port=i.data_port,
                             mem_type=i.mem_type, device_id=i.device_id)


def info_from_proto(m: pb.HandshakeReply) -> SourceInfo:
    return SourceInfo(worker_id=m.worker_id, backend=m.backend,  # type: ignore[arg-type]
                      compat=compat_from_proto(m.compat), num_blocks=m.num_blocks,
                      block_bytes=m.block_bytes, agent_name=m.agent_name,
                      agent_metadata=m.agent_metadata, base_addr=m.base_addr,
                      mem_type=m.mem_type or "DRAM", device_id=m.device_id,
                      data_host=m.data_host, data_port=m.data_port)


RELEASE = WireEnum(ReleaseReason, pb.ReleaseReason, "RELEASE_")
"""ReleaseReply.reason."""


def ends_lease(reason: ReleaseReason | None) -> bool:
    """Whether a ReleaseReply's reason means the lease is over: any answer but
    UNAUTHORIZED (a wrong token ends nothing); None stands for no answer at all."""
    return reason is not None and reason is not ReleaseReason.UNAUTHORIZED


def blocks_to_proto(b: SourceBlocks) -> pb.KVHandle:
    return pb.KVHandle(worker_id=b.worker_id, transfer_endpoint=b.endpoint,
                       request_id=b.request_id, block_ids=b.block_ids, lease_epoch=b.epoch,
                       lease_deadline_unix_ms=b.deadline_unix_ms, num_tokens=b.num_tokens,
                       lease_token=b.lease_token, block_index=b.block_index)


def blocks_from_proto(m: pb.KVHandle) -> SourceBlocks:
    return SourceBlocks(m.worker_id, m.transfer_endpoint, m.request_id, m.lease_epoch,
                        tuple(m.block_ids), m.lease_deadline_unix_ms, m.num_tokens,
                        m.lease_token, tuple(m.block_index))


class KVLinkServicer(pb_grpc.KVLinkServicer):
    """Source side. ``lease_ended`` runs on the gRPC event loop thread; it must
    be thread-safe against the scheduler that owns the block pool (e.g. post
    the request id to the engine's thread)."""

    def __init__(self, source: KVSource, leases: LeaseTable, lease_ended: LeaseEnded,
                 worker_id: str, secret: bytes) -> None:
        self.source = source
        self.leases = leases
        self.lease_ended = lease_ended
        self.worker_id = worker_id
        self._secret = secret

    async def Handshake(self, request: pb.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> pb.HandshakeReply:
        info = self.source.handshake_info(self.worker_id)
        try:
            # The reader's view: "local" is the reader, so both ends word it alike.
            compat_from_proto(request.compat).check(info.compat)
        except KVCompatError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if request.backend and request.backend != info.backend:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"backend: local {request.backend!r} != remote {info.backend!r} "
                                f"(both workers need the same --kv-transfer)")
        log.info("kv link handshake from %s (%s)", request.reader_id, info.backend)
        reply = info_to_proto(info)
        reply.proof_of_secret = proof(self._secret, request.challenge, info.worker_id)
        return reply

    async def Release(self, request: pb.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        self.reap_expired()
        lease, reason = self.leases.end(request.request_id, request.epoch, request.lease_token)
        if lease is not None:
            self.lease_ended(lease)
        return pb.ReleaseReply(released=lease is not None, reason=RELEASE.to_proto(reason))

    def reap_expired(self) -> int:
        """Free the blocks of every expired lease; returns how many leases.
        The source's service calls this periodically too."""
        gone = self.leases.expire()
        for lease in gone:
            log.warning("kv lease %s epoch %d expired; freeing %d blocks",
                        lease.request_id, lease.epoch, len(lease.block_ids))
            self.lease_ended(lease)
        return len(gone)


def add_kv_link(server: grpc.aio.Server, servicer: KVLinkServicer) -> None:
    pb_grpc.add_KVLinkServicer_to_server(servicer, server)


class KVLinkClient:
    """Destination side, one per source endpoint; methods are coroutines."""

    def __init__(self, endpoint: str, reader_id: str, secret: bytes,
                 rpc_timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.reader_id = reader_id
        self._secret = secret
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = auth_channel(endpoint, secret, interceptors=client_interceptors())
        self._stub = pb_grpc.KVLinkStub(self._channel)

    async def handshake(self, compat: CompatRecord, backend: str) -> SourceInfo:
        """The source's SourceInfo; KVCompatError when the source refuses us."""
        challenge = secrets.token_bytes(16)
        request = pb.HandshakeRequest(compat=compat_to_proto(compat), reader_id=self.reader_id,
                                      backend=backend, challenge=challenge)
        try:
            reply = await self._stub.Handshake(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise KVCompatError(f"{self.endpoint} refused the handshake: {e.details()}") from e
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise KVAuthError(f"{self.endpoint} refused our cluster credentials: "
                                  f"{e.details()}") from e
            raise
        want = proof(self._secret, challenge, reply.worker_id)
        if not hmac.compare_digest(want.encode(), reply.proof_of_secret.encode()):
            raise KVAuthError(f"{self.endpoint} ({reply.worker_id or 'no id'}) could not prove it "
                              "holds the cluster secret; not reading KV from it")
        return info_from_proto(reply)

    async def release(self, request_id: str, epoch: int, token: str
                      ) -> tuple[bool, ReleaseReason | None]:
        """(released, reason) as the source's ReleaseReply says (reason None: a source
        that predates the enum gave none)."""
        reply = await self._stub.Release(
            pb.ReleaseRequest(request_id=request_id, epoch=epoch, lease_token=token),
            timeout=self._rpc_timeout_s)
        return reply.released, RELEASE.from_proto(reply.reason)

    async def pull(self, reader: KVReader, peer: PeerId, plan: ReadPlan,
                   timeout_s: float = 30.0) -> ReadHandle:
        """Read ``plan`` then release its lease, whatever happened.

        Returns the handle: DONE means the bytes are in place and valid; any
        other state means the destination must recompute (``handle.error``
        says why). A read still PENDING at ``timeout_s`` is aborted (FAILED).
        For readers that do not confirm the lease themselves (nixl), a DONE
        read becomes EXPIRED when Release says the lease was gone, and FAILED
        when Release cannot be delivered: either way the blocks may have been
        reused during the read. ValueError/KeyError from ``start_read``
        propagate (nothing was read; the lease is still released).
        """
        try:
            handle = reader.start_read(peer, plan)
            await _poll_until_done(reader, handle, time.monotonic() + timeout_s)
        finally:
            released, reason = await self._release_quietly(plan)
        handle.lease_ended = ends_lease(reason)
        if handle.state is TransferState.DONE and not released and not reader.confirms_lease:
            if reason is not None:
                handle.finish(TransferState.EXPIRED, LeaseError(
                    f"lease {plan.request_id!r} epoch {plan.epoch} was {reason.value} at "
                    f"release; the {handle.nbytes} bytes read are discarded"))
            else:
                handle.finish(TransferState.FAILED, KVTransferError(
                    f"could not release lease {plan.request_id!r} epoch {plan.epoch}, so the "
                    f"one-sided read is unconfirmed; the {handle.nbytes} bytes are discarded"))
        return handle

    async def _release_quietly(self, plan: ReadPlan) -> tuple[bool, ReleaseReason | None]:
        """Release; a failed RPC is logged and reads as (False, None): no answer (the
        source will expire the lease itself)."""
        try:
            return await self.release(plan.request_id, plan.epoch, plan.lease_token)
        except grpc.aio.AioRpcError as e:
            log.warning("kv release of %s epoch %d at %s failed: %s %s", plan.request_id,
                        plan.epoch, self.endpoint, e.code().name, e.details())
            return False, None

    async def close(self) -> None:
        await self._channel.close()


async def _poll_until_done(reader: KVReader, handle: ReadHandle, deadline: float) -> None:
    """Poll without blocking the event loop: back to back for a few rounds (small
    reads end in microseconds), then with growing sleeps up to 1 ms. Past the
    deadline the read is aborted and polled until it is terminal (an aborted read
    may still be letting go of its local blocks)."""
    pauses = poll_pauses()
    while reader.poll(handle) is TransferState.PENDING:
        if time.monotonic() >= deadline:
            reader.abort(handle)
            deadline, pauses = float("inf"), poll_pauses(longest_s=1e-2)
        await asyncio.sleep(next(pauses))
