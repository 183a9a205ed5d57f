"""NIXL backend: one-sided READs over UCX (CMA between processes of one host,
RDMA between hosts, GPU memory directly where UCX has CUDA support).

Both sides register their whole KV tensor once. The source's handshake exports
its NIXL agent metadata (NIXL's own binary format, not a pickle), the address
of block 0 and the block size; the reader loads that metadata and builds
descriptor lists itself from ``(address, length, device)`` tuples, one
descriptor per block (blocks are contiguous), prepared once per peer. A read
is one ``READ`` request indexing into those lists; NIXL merges adjacent blocks.

Progress: NIXL's progress thread busy-polls a whole core, so it stays off.
The reader progresses its transfers from ``poll``/``wait``. The source has no
transfers of its own, but UCX needs it to answer connection wire-up once per
new reader, so ``serve`` starts a thread that progresses the agent every
``progress_interval_s`` (5 ms: ~1% of a core idle; after wire-up reads
complete without it). ``connect`` requests the connection at once so wire-up
overlaps the wait for the first read (which still takes ~15-25 ms here).

Re-handshake: a ``connect`` for a known peer whose agent changed (the source
restarted) loads the new agent and points new reads at it; it neither waits nor
cuts anything. Reads in flight on the old agent finish on it (DONE with the right
bytes from a live source, FAILED when UCX reports the old source gone, or aborted
at the pull's timeout), and the old descriptor list and remote agent are released
when the last of them ends (kvtransfer/peer_table.py), never under a READ in flight.
``disconnect`` (the source left) does the same without a new agent.

Teardown: UCX aborts the whole process (an arbiter assertion) when an agent
is destroyed while requests to a peer that died are still queued; ``close``
progresses the agent for ~20 ms first, which flushes them.

A tensor-parallel group (kvtransfer/group_kv.py): each rank holds only its heads, and a
READ cannot gather them, so rank 0 registers the group's mirror (every head, row b for
block b) instead of a pool. The source ``stage``s a request's blocks into its mirror
(one gather, on the engine thread) before the request's handle leaves the worker; the
reader READs into its own mirror's rows of the plan's local blocks and, once NIXL says
DONE, scatters them to the ranks on threads of its own (the read stays PENDING until
the scatter is over, so no step reads a block before every rank holds it). The mirror's
rows belong to whoever owns their blocks (the lease, the pull): no accounting of their
own. It costs rank 0 one host copy of the pool with every head, on either side.

Release does not use NIXL notifications: it travels over the KVLink gRPC
``Release`` for every backend, and its reply is what validates a one-sided
read (see base.py): NIXL cannot check a lease when the source's CPU is not
involved in the READ.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from nixl_cu12 import nixl_agent, nixl_agent_config

from kvtransfer.base import (Backend, CompatRecord, KVReader, KVSource, KVTransferError,
                             LeaseCheck, PeerId, ReadHandle, ReadPlan, SourceInfo, TransferState)
from kvtransfer.group_kv import GroupKV, registered
from kvtransfer.in_flight import InFlightReads

log = logging.getLogger(__name__)

SCATTER_THREADS = 4
"""A group reader's scatters at once (tcp's reader runs as many reads at once)."""


def _new_agent(prefix: str) -> nixl_agent:
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                               backends=["UCX"])
    agent = nixl_agent(f"{prefix}-{uuid.uuid4().hex[:12]}", config)
    if "UCX" not in agent.backends:
        raise KVTransferError("NIXL has no UCX backend here (plugin missing)")
    return agent


def _mem(kv: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of ``kv``."""
    return ("DRAM", 0) if kv.device.type == "cpu" else ("VRAM", kv.device.index or 0)


def _agent_holding(kv: torch.Tensor, prefix: str) -> tuple[nixl_agent, object]:
    """A new agent and its registration of the whole of ``kv`` (pinned until deregistered)."""
    mem, device = _mem(kv)
    agent = _new_agent(prefix)
    nbytes = kv.numel() * kv.element_size()
    return agent, agent.register_memory([(kv.data_ptr(), nbytes, device, "")], mem)


def _block_descs(base_addr: int, block_bytes: int, num_blocks: int, device: int) -> np.ndarray:
    """``[num_blocks, 3]`` (address, length, device) rows: one descriptor per block."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device
    return descs


class NixlSource(KVSource):
    name = "nixl"

    def __init__(self, progress_interval_s: float = 0.005,
                 advertise_host: str | None = None) -> None:
        """advertise_host: unused (UCX wire-up carries the addresses in the agent
        metadata)."""
        self._progress_interval_s = progress_interval_s
        self._lock = threading.Lock()
        self._agent: nixl_agent | None = None
        self._reg = None
        self._kv: torch.Tensor | None = None
        """What readers READ: the KV tensor, or a group's mirror."""
        self._group: GroupKV | None = None
        self._compat: CompatRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, kv: torch.Tensor | GroupKV, compat: CompatRecord,
                 lease_check: LeaseCheck) -> None:
        """``lease_check`` is unused: READs are one-sided, so the lease is
        validated by the gRPC Release reply instead (module docstring)."""
        _, group, _ = registered(kv, compat)
        with self._lock:
            if self._agent is not None:
                raise RuntimeError("NixlSource.register called twice")
            served = kv if group is None else group.mirror()
            self._agent, self._reg = _agent_holding(served, "tandem-kvsrc")
            self._kv, self._group, self._compat = served, group, compat

    @property
    def stages(self) -> bool:
        return self._group is not None

    def stage(self, block_ids: Sequence[int]) -> None:
        """A group's blocks ``block_ids`` into the mirror readers READ (module docstring)."""
        if self._group is not None:
            self._group.read(block_ids, into=self._kv)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._agent is None:
            raise RuntimeError("NixlSource.serve before register")
        self._thread = threading.Thread(target=self._progress_loop, name="kv-nixl-progress",
                                        daemon=True)
        self._thread.start()

    def handshake_info(self, worker_id: str) -> SourceInfo:
        assert self._agent is not None and self._kv is not None and self._compat is not None
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        mem, device = _mem(self._kv)
        return SourceInfo(worker_id, "nixl", self._compat, self._kv.shape[0],
                          self._compat.block_bytes, agent_name=self._agent.name,
                          agent_metadata=metadata, base_addr=self._kv.data_ptr(),
                          mem_type=mem, device_id=device)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._agent is not None:
                _drain(self._agent)
                if self._reg is not None:
                    self._agent.deregister_memory(self._reg)
            self._agent, self._reg, self._kv = None, None, None

    def _progress_loop(self) -> None:
        while not self._stop.wait(self._progress_interval_s):
            with self._lock:
                if self._agent is None:
                    return
                self._agent.get_new_notifs()  # progresses UCX (wire-up of new readers)


def _drain(agent: nixl_agent, rounds: int = 20, pause_s: float = 0.001) -> None:
    """Progress the agent for a few ms before it is destroyed: UCX aborts the
    process (arbiter assertion) when a worker is torn down while requests to a
    dead peer are still queued, and progress is what flushes them."""
    for _ in range(rounds):
        agent.get_new_notifs()
        time.sleep(pause_s)


@dataclass(eq=False)
class _Remote:
    """One source as the reader knows it: its NIXL agent's name and the descriptor
    list of its blocks."""

    agent_name: str
    remote_dlist: object
    num_blocks: int


class NixlReader(KVReader):
    """All agent calls happen under one lock (the agent runs without NIXL's
    own thread-safety: sync mode NONE)."""

    name = "nixl"
    confirms_lease = False

    def __init__(self) -> None:
        super().__init__()
        self._agent: nixl_agent | None = None
        self._reg = None
        self._local_dlist = None
        self._kv: torch.Tensor | None = None
        """Where READs land: the KV tensor, or a group's mirror."""
        self._group: GroupKV | None = None
        self._scatters: dict[ReadHandle, cf.Future] = {}
        """A group's reads that NIXL finished, while their scatter to the ranks runs."""
        self._aborted: set[ReadHandle] = set()
        """Of those, the ones aborted: they end FAILED when the scatter lets go."""
        self._pool: cf.ThreadPoolExecutor | None = None
        """The scatters' threads (a group only): a scatter waits for the engine thread,
        so several pulls' scatters can run at one step boundary (as tcp's reads)."""
        self._compat: CompatRecord | None = None
        self._agents: dict[str, int] = {}
        """Remote agent name -> peer states using it (the agent is loaded while > 0)."""
        self._reads: InFlightReads[_Remote] = InFlightReads(self._peers, _release_xfer)
        """Each read's ``impl`` is its NIXL request (None until made, and once released)."""

    def register(self, kv: torch.Tensor | GroupKV, compat: CompatRecord) -> None:
        _, group, _ = registered(kv, compat)
        with self._lock:
            if self._agent is not None:
                raise RuntimeError("NixlReader.register called twice")
            landing = kv if group is None else group.mirror()
            self._agent, self._reg = _agent_holding(landing, "tandem-kvread")
            mem, device = _mem(landing)
            descs = _block_descs(landing.data_ptr(), compat.block_bytes, landing.shape[0],
                                 device)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
            self._kv, self._group, self._compat = landing, group, compat
            if group is not None:
                self._pool = cf.ThreadPoolExecutor(SCATTER_THREADS,
                                                   thread_name_prefix="kv-nixl-scatter")

    def connect(self, info: SourceInfo) -> PeerId:
        assert self._agent is not None and self._compat is not None, "register before connect"
        info.check_reader(self._compat, "nixl", reachable=bool(info.agent_metadata))
        peer = PeerId(info.worker_id)
        with self._lock:
            known = self._peers.get(peer)
            if known is not None and known.agent_name == info.agent_name:
                return peer
            # New or restarted source (new agent): new reads use the fresh metadata; reads in
            # flight on the old agent end on it, which is released after them (PeerTable).
            self._peers.set(peer, self._load_remote(info))
        return peer

    def start_read(self, peer: PeerId, plan: ReadPlan) -> ReadHandle:
        assert self._agent is not None and self._kv is not None, "register before start_read"
        with self._lock:
            remote = self._peers[peer]
            plan.check_bounds(remote.num_blocks, self._kv.shape[0])
            handle = self._reads.start(peer, plan, self._compat.block_bytes)
            try:
                handle.impl = self._agent.make_prepped_xfer(
                    "READ", self._local_dlist, np.asarray(plan.local_block_ids, dtype=np.int32),
                    remote.remote_dlist, np.asarray(plan.remote_block_ids, dtype=np.int32))
            except Exception as e:
                self._reads.end(handle, TransferState.FAILED,
                                KVTransferError(f"NIXL refused the read: {e!r}"))
                return handle
            self._advance(handle, lambda: self._agent.transfer(handle.impl))
        return handle

    def poll(self, handle: ReadHandle) -> TransferState:
        with self._lock:
            if handle in self._scatters:
                self._end_scatter(handle)
            elif not handle.state.terminal and self._agent is not None:
                self._advance(handle, lambda: self._agent.check_xfer_state(handle.impl))
        return handle.state

    def abort(self, handle: ReadHandle) -> None:
        """Ends the read FAILED now: releasing its NIXL request aborts the READ. A
        group's read whose scatter runs ends FAILED when the scatter is over (its blocks
        are written until then)."""
        with self._lock:
            if handle in self._scatters:
                self._aborted.add(handle)
                return
            self._reads.end(handle, TransferState.FAILED, KVTransferError("read aborted"))

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:  # not waited for: a scatter waits for the event loop
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._scatters.clear()
            self._aborted.clear()
            for handle in self._reads.pending():
                self._reads.end(handle, TransferState.FAILED, KVTransferError("reader closed"))
            if self._agent is not None:
                self._peers.clear()
                _drain(self._agent)
                if self._local_dlist is not None:
                    self._local_dlist.release()
                if self._reg is not None:
                    self._agent.deregister_memory(self._reg)
            self._agent, self._reg, self._local_dlist, self._kv = None, None, None, None

    # -- under self._lock -------------------------------------------------

    def _load_remote(self, info: SourceInfo) -> _Remote:
        """Load the source's agent (once per agent name) and prepare its descriptors."""
        name = info.agent_name
        if name not in self._agents:
            loaded = self._agent.add_remote_agent(info.agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                if loaded not in self._agents:
                    self._agent.remove_remote_agent(loaded)
                raise KVTransferError(f"agent metadata names {loaded!r}, handshake says {name!r}")
            self._agents[name] = 0
        self._agents[name] += 1
        try:
            descs = _block_descs(info.base_addr, info.block_bytes, info.num_blocks, info.device_id)
            remote = self._agent.prep_xfer_dlist(name, descs, info.mem_type)
        except Exception as e:
            self._unref_agent(name)
            raise KVTransferError(f"NIXL rejected the descriptors of {info.worker_id!r} "
                                  f"({info.num_blocks} blocks at {info.base_addr:#x}): {e!r}") from e
        try:
            self._agent.make_connection(name)  # start UCX wire-up now, not on the first read
        except Exception:
            pass  # optional: the first READ connects anyway and reports real failures
        return _Remote(name, remote, info.num_blocks)

    def _release_peer(self, remote: _Remote) -> None:
        """No read uses ``remote`` any more. It runs inside poll, abort, connect and
        disconnect, so a NIXL error is logged, never raised."""
        try:
            remote.remote_dlist.release()
        except Exception:  # noqa: BLE001 - the agent's own teardown frees it at close
            log.exception("NIXL could not release the descriptors of %s", remote.agent_name)
        self._unref_agent(remote.agent_name)

    def _unref_agent(self, name: str) -> None:
        self._agents[name] -= 1
        if self._agents[name] == 0:
            del self._agents[name]
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - as above
                log.exception("NIXL could not remove remote agent %s", name)

    def _advance(self, handle: ReadHandle, step: Callable[[], str]) -> None:
        """Run one NIXL post/check call and move the handle on accordingly."""
        try:
            status = step()
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the source is gone
            self._reads.end(handle, TransferState.FAILED,
                            KVTransferError(f"NIXL read from {handle.peer} failed: {e!r}"))
            return
        if status == "DONE" and self._group is not None:
            self._start_scatter(handle)
        elif status == "DONE":
            self._reads.end(handle, TransferState.DONE)
        elif status != "PROC":
            self._reads.end(handle, TransferState.FAILED,
                            KVTransferError(f"NIXL read from {handle.peer} ended in {status}"))

    def _start_scatter(self, handle: ReadHandle) -> None:
        """A group's read landed in the mirror: send each rank its heads (module
        docstring), on the scatter thread; the read stays PENDING meanwhile."""
        ids = list(handle.plan.local_block_ids)
        rows = self._kv[torch.tensor(ids, dtype=torch.int64)]  # a copy: the READ is over
        self._scatters[handle] = self._pool.submit(self._group.write, ids, rows)

    def _end_scatter(self, handle: ReadHandle) -> None:
        """End a scattering read once its scatter let go: DONE, or FAILED when it failed
        or the read was aborted meanwhile."""
        future = self._scatters[handle]
        if not future.done():
            return
        del self._scatters[handle]
        aborted = handle in self._aborted
        self._aborted.discard(handle)
        error = None if future.cancelled() else future.exception()
        if aborted or future.cancelled():
            self._reads.end(handle, TransferState.FAILED, KVTransferError("read aborted"))
        elif error is not None:
            self._reads.end(handle, TransferState.FAILED, KVTransferError(
                f"the group's scatter of {handle.plan.num_blocks} blocks failed: {error!r}"))
        else:
            self._reads.end(handle, TransferState.DONE)


def _release_xfer(handle: ReadHandle) -> Exception | None:
    """InFlightReads' ``free_read``: release the read's NIXL request (releasing an unfinished
    one makes NIXL abort it). A release that fails is left to the agent's own leak list
    (nixl_xfer_handle.__del__), never retried by us, and the read keeps its peer state (NIXL
    may still be using its descriptors) until close."""
    xfer, handle.impl = handle.impl, None
    if xfer is None:
        return None
    try:
        xfer.release()
    except Exception as e:  # noqa: BLE001 - reported through the handle
        return KVTransferError(f"NIXL could not release the read: {e!r}")
    return None


BACKEND = Backend("nixl", NixlSource, NixlReader)
