"""In-process backend for unit tests: copies blocks between two tensors of one process.

Same contract as the real backends, including the compat check at connect and
the lease check before and after the copy, so scheduler tests exercise the
handoff without sockets. Reads complete synchronously inside ``start_read``.
"""
from __future__ import annotations

import uuid
import weakref

import torch

from kvtransfer.base import (Backend, CompatRecord, KVReader, KVTransferError, LeaseError, PeerId,
                             ReadHandle, ReadPlan, SourceInfo, TransferState, block_view)
from kvtransfer.copy_source import CopySource
from kvtransfer.in_flight import InFlightReads

_LIVE: weakref.WeakValueDictionary[str, LocalSource] = weakref.WeakValueDictionary()
"""Serving sources of this process by name; what ``connect`` resolves."""


class LocalSource(CopySource):
    name = "local"

    def __init__(self, advertise_host: str | None = None) -> None:
        """advertise_host: unused (readers find an in-process source by name)."""
        super().__init__()
        self._agent_name = f"local-src-{uuid.uuid4().hex[:12]}"

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._require_registered("serve")
        _LIVE[self._agent_name] = self

    def handshake_info(self, worker_id: str) -> SourceInfo:
        assert self._blocks is not None and self._compat is not None
        return SourceInfo(worker_id, "local", self._compat, self._blocks.shape[0],
                          self._blocks.shape[1], agent_name=self._agent_name)

    def close(self) -> None:
        _LIVE.pop(self._agent_name, None)
        with self._lock:
            self._blocks = None

    def read_into(self, plan: ReadPlan, dst: torch.Tensor) -> None:
        """Copy ``plan``'s blocks into ``dst`` (a reader's block view) under the
        lease; LeaseError if it is not live before or after the copy."""
        with self._lock:
            if self._blocks is None or self._lease_check is None:
                raise KVTransferError("local source is closed")
            src, check = self._blocks, self._lease_check
        check(plan.request_id, plan.epoch, plan.lease_token, plan.remote_block_ids)
        dst[list(plan.local_block_ids)] = src[list(plan.remote_block_ids)]
        check(plan.request_id, plan.epoch, plan.lease_token, plan.remote_block_ids)


class LocalReader(KVReader):
    name = "local"
    confirms_lease = True

    def __init__(self) -> None:
        super().__init__()
        self._blocks: torch.Tensor | None = None
        self._compat: CompatRecord | None = None
        self._reads: InFlightReads[tuple[str, int]] = InFlightReads(self._peers)
        """A read is in flight only while ``start_read`` copies it, and ends there."""

    def register(self, kv: torch.Tensor, compat: CompatRecord) -> None:
        compat.check_tensor(kv)
        self._blocks, self._compat = block_view(kv), compat

    def connect(self, info: SourceInfo) -> PeerId:
        assert self._compat is not None, "register before connect"
        self._compat.check(info.compat)
        if info.backend != "local" or info.agent_name not in _LIVE:
            raise KVTransferError(f"no in-process local source {info.agent_name!r} "
                                  f"(backend {info.backend!r})")
        peer = PeerId(info.worker_id)
        with self._lock:
            self._peers.set(peer, (info.agent_name, info.num_blocks))
        return peer

    def start_read(self, peer: PeerId, plan: ReadPlan) -> ReadHandle:
        """The read runs here, on the caller's thread, outside the lock, and has ended when
        this returns."""
        assert self._blocks is not None, "register before start_read"
        with self._lock:
            agent_name, remote_blocks = self._peers[peer]
            plan.check_bounds(remote_blocks, self._blocks.shape[0])
            handle = self._reads.start(peer, plan, self._blocks.shape[1])
        state, error = _copy(agent_name, plan, self._blocks)
        with self._lock:
            self._reads.end(handle, state, error)
        return handle

    def poll(self, handle: ReadHandle) -> TransferState:
        return handle.state

    def abort(self, handle: ReadHandle) -> None:
        """Reads end inside ``start_read``, which ends one that another thread tries to
        abort meanwhile (its bytes are still landing)."""

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
        self._blocks = None


def _copy(agent_name: str, plan: ReadPlan, dst: torch.Tensor) -> tuple[TransferState, Exception | None]:
    """Copy ``plan``'s blocks from the in-process source ``agent_name`` into ``dst``."""
    source = _LIVE.get(agent_name)
    try:
        if source is None:
            raise KVTransferError(f"local source {agent_name!r} is gone")
        source.read_into(plan, dst)
    except LeaseError as e:
        return TransferState.EXPIRED, e
    except KVTransferError as e:
        return TransferState.FAILED, e
    return TransferState.DONE, None


BACKEND = Backend("local", LocalSource, LocalReader)
