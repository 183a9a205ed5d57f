"""The KV transfer contract: what a source exports, what a reader asks, who moves bytes.

Two halves, kept apart (scheduler-side bookkeeping, worker-side bytes):

* Scheduler side, bookkeeping only, no bytes move: ``LeaseTable`` (lease.py) on
  the source; ``SourceBlocks`` (what a source exports for one request, the
  mirror of proto ``KVHandle``) and ``ReadPlan`` (what a destination asks for:
  remote block ids -> local block ids).
* Worker side, byte movement: ``KVSource`` (registers the source's KV tensor
  and serves reads of it) and ``KVReader`` (pulls blocks into the
  destination's KV tensor). ``SourceInfo`` is what a source tells a reader at
  handshake; ``ReadHandle`` tracks one read; ``TransferState`` is its state.

Wiring (link.py carries the control messages over gRPC)::

    source:  src = get_backend(name).source()
             src.register(kv, compat, lease_check=leases.check_readable)
             src.serve("127.0.0.1")            # KVLinkServicer publishes src.handshake_info()
    reader:  rd = get_backend(name).reader()
             rd.register(kv, compat)
             info = await client.handshake(compat, name)
             peer = rd.connect(info)            # raises KVCompatError on any mismatch
             handle = await client.pull(rd, peer, plan)   # start_read + poll + Release

Ownership: bytes a reader got are valid only if the source's lease was live for
the whole read. Sources that see reads (tcp, local) check the lease before and
after moving bytes (``KVReader.confirms_lease``); for one-sided NIXL READs the
authority is the Release reply (blocks are freed only by release or expiry, so
``released=True`` proves they were pinned during a read that ended before the
Release was sent). ``KVLinkClient.pull`` applies that rule. Release always
travels over the KVLink gRPC ``Release``, for every backend.

The KV tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
row]``, contiguous, so block ``b`` is one region of ``block_bytes`` at
``data_ptr() + b * block_bytes``. A row is head_dim values, or, for a quantized
``kv_cache_dtype``, head_dim codes and their bfloat16 scale (``kv_scale_layout``,
core/kv/layout.py): the scales travel inside the block, so every backend moves
quantized blocks as they are.
"""
from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterator, Literal, NewType, Sequence, Sized

import torch

from core.kv.layout import SCALE_BYTES, is_quantized, kv_format_block_bytes, scale_layout
from core.registry import RegistryError
from kvtransfer.registry import KV_BACKENDS
from kvtransfer.peer_table import PeerTable

KV_LAYOUT = "block_major:[L,2,B,Hkv,D]"
"""Layout string of the block-major KV tensor every backend assumes."""

BackendName = Literal["nixl", "tcp", "local"]
PeerId = NewType("PeerId", str)
"""A reader's name for a connected source (the source's worker id)."""

LeaseCheck = Callable[[str, int, str, Sequence[int]], None]
"""``(request_id, epoch, lease_token, block_ids) -> None``; raises LeaseError when
the blocks may not be read. ``LeaseTable.check_readable`` is the usual one."""


class KVTransferError(RuntimeError):
    """A transfer could not be done; the destination should recompute."""


class KVCompatError(KVTransferError):
    """Two workers' KV caches are not interchangeable (raised at connect time)."""


class KVAuthError(KVTransferError):
    """A peer that could not authenticate as a member of the cluster."""


class LeaseError(KVTransferError):
    """The lease does not allow this read: unknown, expired, released, wrong
    epoch, or blocks outside the lease."""


class KVBackendUnavailable(ValueError):
    """``--kv-transfer`` names a backend that does not exist or cannot load here."""


class TransferState(enum.Enum):
    PENDING = "pending"
    """Bytes may still be moving."""
    DONE = "done"
    """Every byte landed and the source saw a live lease (see module docstring
    for NIXL, where only the Release reply can confirm that)."""
    FAILED = "failed"
    """Transport failure or refused request (peer gone, malformed, timeout,
    aborted); ``handle.error`` says which. Local blocks hold garbage."""
    EXPIRED = "expired"
    """The lease was not live (expired, released, unknown); ``handle.error`` is
    a LeaseError. Local blocks hold garbage."""

    @property
    def terminal(self) -> bool:
        return self is not TransferState.PENDING


@dataclass(frozen=True)
class CompatRecord:
    """Everything that must match before KV blocks are interchangeable
    (mirror of proto ``CompatRecord``)."""

    model_fingerprint: str
    """Digest of architecture and weights; opaque."""
    dtype: str
    """The engine's compute dtype, torch name without ``torch.``, e.g. ``bfloat16``."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str = KV_LAYOUT
    kv_cache_dtype: str = ""
    """How K/V are stored (--kv-cache-dtype, resolved): bfloat16, float32, int8, fp8_e4m3;
    empty (an older peer) means ``dtype``."""
    kv_scale_layout: str = ""
    """Where quantized rows keep their scales (layout.SCALE_LAYOUT) or ``none``; empty
    means the layout kv_cache_dtype implies."""
    tensor_parallel_size: int = 1
    """The sender's group size. Not compared: num_kv_heads is the model's total and a
    block on the wire carries every head whatever either side's TP (kvtransfer/group_kv.py)."""
    rank_kv_heads: tuple[int, ...] = ()
    """Which KV heads each rank holds, rank after rank (empty: one rank holds all)."""

    GROUP_FIELDS: ClassVar[frozenset[str]] = frozenset({"tensor_parallel_size", "rank_kv_heads"})
    """The fields that describe one side's group, not the KV: never required equal."""

    def __post_init__(self) -> None:
        if not self.kv_cache_dtype:
            object.__setattr__(self, "kv_cache_dtype", self.dtype)
        if not self.kv_scale_layout:
            object.__setattr__(self, "kv_scale_layout", scale_layout(self.kv_cache_dtype))
        object.__setattr__(self, "tensor_parallel_size", self.tensor_parallel_size or 1)
        object.__setattr__(self, "rank_kv_heads", tuple(self.rank_kv_heads))
        tp, heads = self.tensor_parallel_size, len(self.rank_kv_heads)
        if heads and heads % tp:  # a peer's record (Handshake): its group must be one
            raise KVCompatError(f"rank_kv_heads: {heads} entries cannot be split evenly over "
                                f"tensor_parallel_size {tp} ranks")

    @classmethod
    def from_kv(cls, kv: torch.Tensor, model_fingerprint: str, kv_cache_dtype: str = "",
                dtype: str = "", head_map: Sequence[Sequence[int]] = ()) -> CompatRecord:
        """The record of a block-major KV tensor ``[N, L, 2, B, Hkv, row]``. A quantized
        cache (kv_cache_dtype int8 | fp8_e4m3) must say so and give its compute dtype;
        otherwise both are the tensor's dtype. ``head_map``: rank 0's tensor of a
        tensor-parallel group holds its own heads only; each rank's heads, in rank order."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(f"kv must be [num_blocks, num_layers, 2, block_size, "
                             f"num_kv_heads, head_dim], got shape {tuple(kv.shape)}")
        _, layers, _, block_size, heads, row = kv.shape
        stored = str(kv.dtype).removeprefix("torch.")
        kv_cache_dtype = kv_cache_dtype or stored
        head_dim = row - SCALE_BYTES if is_quantized(kv_cache_dtype) else row
        group = {}
        if len(head_map) > 1:
            if any(len(h) != heads for h in head_map):
                raise ValueError(f"head map {head_map} does not give each rank {heads} heads")
            heads = len({h for rank in head_map for h in rank})
            group = {"tensor_parallel_size": len(head_map),
                     "rank_kv_heads": tuple(h for rank in head_map for h in rank)}
        return cls(model_fingerprint, dtype or stored, block_size, layers, heads, head_dim,
                   KV_LAYOUT, kv_cache_dtype, **group)

    def head_map(self) -> list[tuple[int, ...]]:
        """Each rank's KV heads, in rank order (one rank: every head)."""
        if self.tensor_parallel_size == 1 or not self.rank_kv_heads:
            return [tuple(range(self.num_kv_heads))]
        n = len(self.rank_kv_heads) // self.tensor_parallel_size
        return [self.rank_kv_heads[r * n:(r + 1) * n] for r in range(self.tensor_parallel_size)]

    def describe_heads(self) -> str:
        """The head layout in words: ``4 KV heads x head_dim 16 over TP 2 (ranks hold
        [0, 1] [2, 3])``."""
        text = f"{self.num_kv_heads} KV heads x head_dim {self.head_dim}"
        if self.tensor_parallel_size == 1:
            return text + " on one rank"
        ranks = " ".join(str(list(h)) for h in self.head_map())
        return text + f" over TP {self.tensor_parallel_size} (ranks hold {ranks})"

    @property
    def block_bytes(self) -> int:
        return kv_format_block_bytes(self.kv_cache_dtype, self.num_layers, self.block_size,
                                     self.num_kv_heads, self.head_dim)

    def check(self, remote: CompatRecord) -> None:
        """Raise KVCompatError naming every field that differs, with both values
        (``block_size: local 16 != remote 32``); return None when they match."""
        diffs = [f"{f.name}: local {getattr(self, f.name)!r} != remote {getattr(remote, f.name)!r}"
                 for f in fields(self) if f.name not in self.GROUP_FIELDS
                 and getattr(self, f.name) != getattr(remote, f.name)]
        if self.kv_cache_dtype != remote.kv_cache_dtype:
            diffs.append("start prefill and decode workers with the same --kv-cache-dtype")
        if (self.num_kv_heads, self.head_dim) != (remote.num_kv_heads, remote.head_dim):
            diffs.append(f"head layouts cannot be mapped: local {self.describe_heads()}, "
                         f"remote {remote.describe_heads()}")
        if diffs:
            raise KVCompatError("incompatible KV caches: " + "; ".join(diffs))

    def check_tensor(self, kv: torch.Tensor) -> None:
        """Raise ValueError unless ``kv`` is a contiguous tensor this record describes."""
        if not isinstance(kv, torch.Tensor):  # a GroupKV (kvtransfer/group_kv.py)
            raise ValueError("this KV transfer backend moves one tensor's blocks; a tensor-"
                             "parallel group's KV moves over --kv-transfer tcp or nixl")
        if not kv.is_contiguous():
            raise ValueError("kv must be contiguous (block b is one region of block_bytes)")
        quantized = is_quantized(self.kv_cache_dtype)
        if quantized and kv.dtype != torch.int8:
            raise ValueError(f"kv tensor does not match its compat record: a {self.kv_cache_dtype} "
                             f"cache is stored as int8 bytes, got {kv.dtype}")
        mine = CompatRecord.from_kv(kv, self.model_fingerprint,
                                    self.kv_cache_dtype if quantized else "",
                                    self.dtype if quantized else "", self.head_map())
        if mine != self:
            raise ValueError(f"kv tensor does not match its compat record: {mine} vs {self}")


@dataclass(frozen=True)
class SourceInfo:
    """Worker side, source -> reader at handshake (mirror of ``HandshakeReply``)."""

    worker_id: str
    backend: BackendName
    compat: CompatRecord
    num_blocks: int
    block_bytes: int
    agent_name: str = ""
    """NIXL agent name (nixl) or in-process source name (local)."""
    agent_metadata: bytes = b""
    """NIXL agent metadata, NIXL's own binary format (nixl only)."""
    base_addr: int = 0
    """Address of the source's block 0 (nixl only)."""
    mem_type: str = "DRAM"
    """NIXL memory type of the source tensor, DRAM or VRAM (nixl only)."""
    device_id: int = 0
    """CUDA device index of the source tensor, 0 for DRAM (nixl only)."""
    data_host: str = ""
    """TCP data server host (tcp only)."""
    data_port: int = 0
    """TCP data server port (tcp only)."""

    def check_reader(self, compat: CompatRecord, backend: BackendName, reachable: bool) -> None:
        """Raise unless a ``backend`` reader whose cache is ``compat`` can read this source:
        KVCompatError naming the field that differs; KVTransferError when the source serves
        another backend or left out its address (``reachable`` False)."""
        compat.check(self.compat)
        if self.backend != backend or not reachable:
            raise KVTransferError(f"source {self.worker_id!r} serves backend {self.backend!r}, "
                                  f"not {backend}")
        if self.block_bytes != compat.block_bytes:
            raise KVCompatError(f"block_bytes: local {compat.block_bytes} "
                                f"!= remote {self.block_bytes}")


@dataclass(frozen=True)
class SourceBlocks:
    """Scheduler side, source -> destination: one request's leased blocks
    (mirror of proto ``KVHandle``; link.py converts)."""

    worker_id: str
    endpoint: str
    """host:port of the source's KVLink gRPC server."""
    request_id: str
    epoch: int
    block_ids: tuple[int, ...]
    """Source block ids in token order."""
    deadline_unix_ms: int
    num_tokens: int
    lease_token: str = field(default="", repr=False)
    """The lease's secret; reads and the release must present it."""
    block_index: tuple[int, ...] = ()
    """Under a bounded KV policy, the table entry of each of block_ids (the others were
    dropped before the handoff); empty: block_ids[i] is entry i."""

    def entries(self) -> dict[int, int]:
        """Table entry -> source block id, for every block the source kept."""
        return dict(zip(self.block_index or range(len(self.block_ids)), self.block_ids))


@dataclass(frozen=True)
class ReadPlan:
    """Scheduler side, destination: which source blocks land in which local
    blocks, under which lease. Validated on construction."""

    request_id: str
    epoch: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    lease_token: str = field(default="", repr=False)
    """From the source's handle; without it the source refuses the read."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", tuple(int(b) for b in self.remote_block_ids))
        object.__setattr__(self, "local_block_ids", tuple(int(b) for b in self.local_block_ids))
        if not self.remote_block_ids:
            raise ValueError("read plan: no blocks to read")
        if len(self.remote_block_ids) != len(self.local_block_ids):
            raise ValueError(f"read plan: {len(self.remote_block_ids)} remote blocks but "
                             f"{len(self.local_block_ids)} local blocks")
        if min(self.remote_block_ids) < 0 or min(self.local_block_ids) < 0:
            raise ValueError("read plan: negative block id")
        if len(set(self.local_block_ids)) != len(self.local_block_ids):
            raise ValueError("read plan: a local block id appears twice")

    @classmethod
    def from_source(cls, blocks: SourceBlocks, local_block_ids: Sequence[int],
                    skip: int = 0) -> ReadPlan:
        """Read ``blocks.block_ids[skip:]`` (the first ``skip`` blocks are a
        prefix the destination already holds) into ``local_block_ids``."""
        return cls(blocks.request_id, blocks.epoch, blocks.block_ids[skip:], tuple(local_block_ids),
                   blocks.lease_token)

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)

    def check_bounds(self, remote_num_blocks: int, local_num_blocks: int) -> None:
        """Raise ValueError naming the first id outside either tensor."""
        for side, ids, limit in (("remote", self.remote_block_ids, remote_num_blocks),
                                 ("local", self.local_block_ids, local_num_blocks)):
            bad = [b for b in ids if b >= limit]
            if bad:
                raise ValueError(f"read plan: {side} block id {bad[0]} out of range "
                                 f"(the {side} cache has {limit} blocks)")


@dataclass(eq=False)
class ReadHandle:
    """Worker side, one read. Its reader moves it out of PENDING exactly once;
    ``KVLinkClient.pull`` may downgrade DONE to EXPIRED when Release says the
    lease was gone."""

    peer: PeerId
    plan: ReadPlan
    nbytes: int
    state: TransferState = TransferState.PENDING
    error: Exception | None = None
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    impl: Any = field(default=None, repr=False)
    """Backend-private state (xfer handle, future, socket)."""
    lease_ended: bool = False
    """Set by ``KVLinkClient.pull``: the source answered the Release, so the lease is over
    (released, expired, a duplicate; not UNAUTHORIZED, which ends nothing)."""

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def finish(self, state: TransferState, error: Exception | None = None) -> None:
        """Record the terminal state (error first, so a reader of ``state``
        never sees a terminal state without its error)."""
        assert state.terminal
        self.error = error
        if self.finished_at is None:
            self.finished_at = time.monotonic()
        self.state = state


class KVSource(ABC):
    """Source side of one backend: exposes one KV tensor to readers.

    Constructed with at least the keyword ``advertise_host`` (the address readers
    should dial when ``serve`` binds a wildcard; backends that need none ignore it).
    Lifecycle: ``register`` once, ``serve`` once, ``handshake_info`` any number of
    times, ``close`` once (idempotent). Methods may be called from any thread;
    implementations serialize on an internal lock. The source never frees or
    reuses blocks itself: the owner frees them when the LeaseTable says so.
    """

    name: ClassVar[BackendName]

    @abstractmethod
    def register(self, kv: torch.Tensor, compat: CompatRecord, lease_check: LeaseCheck) -> None:
        """Take ``kv`` (which must match ``compat``) for serving. Side effects:
        nixl registers the whole tensor with UCX (pinned until close). The
        tensor must stay alive and must not be reallocated until ``close``.
        ``lease_check`` is called before (and after) serving a read, from the
        source's serving threads."""

    @abstractmethod
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Start the data path and return at once. tcp: binds ``host:port``
        (0 = any free port) and accepts reads on daemon threads; nixl: starts a
        thread that progresses the agent every few ms (NIXL's own progress
        thread busy-polls a core, so it stays off); local: publishes the
        source to readers in this process."""

    @abstractmethod
    def handshake_info(self, worker_id: str) -> SourceInfo:
        """What a reader needs to connect; pure, after ``serve``."""

    stages: bool = False
    """Whether blocks must be ``stage``d before a reader may read them (nixl serving a
    tensor-parallel group); False: ``stage`` does nothing and need not be called."""

    def stage(self, block_ids: Sequence[int]) -> None:
        """Make blocks ``block_ids``, leased just now, readable: call it before their
        handle leaves the worker. Blocking (a group's gather waits for the engine
        thread): never call it on the event loop. Nothing by default."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving, drop connections, deregister memory. Idempotent."""

    def __enter__(self) -> KVSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReader(ABC):
    """Destination side of one backend: pulls source blocks into one KV tensor.

    Lifecycle: ``register`` once, ``connect`` per source (again when the source
    restarted), any number of reads, ``disconnect`` when a source left, ``close`` once
    (idempotent). Every method is thread-safe and, except ``wait``, non-blocking
    (``connect`` may take a few ms). A read whose blocks are written into ``kv`` is the
    caller's to order against compute: do not run attention on the local blocks until
    the read is DONE.

    Per-peer state lives in ``_peers``, a PeerTable (peer_table.py): a re-connect or a
    disconnect never frees state that a read in flight still uses; that read ends on
    the state it started with, and the old state goes when the last such read ends.
    Implementations call ``super().__init__()``, take ``_lock`` in every method, and keep
    their reads in flight in ``_reads``, an InFlightReads over ``_peers`` (in_flight.py:
    each read starts and ends there, once, whoever ends it).
    """

    name: ClassVar[BackendName]
    confirms_lease: ClassVar[bool]
    """True when DONE already proves the lease was live for the whole read (the
    source checked it before and after moving bytes: tcp, local). False for
    one-sided reads (nixl), whose bytes are valid only if Release then says
    ``released=True``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the reader's state; implementations hold it in every method."""
        self._peers: PeerTable[Any] = PeerTable(self._release_peer)
        """Per-peer state (what ``connect`` set up), shared by the reads that use it."""
        self._reads: Sized = ()
        """The reads in flight: the implementation's InFlightReads over ``_peers``."""

    @abstractmethod
    def register(self, kv: torch.Tensor, compat: CompatRecord) -> None:
        """Take ``kv`` (which must match ``compat``) as the destination of reads.
        Side effects: nixl registers the tensor with UCX until close."""

    @abstractmethod
    def connect(self, info: SourceInfo) -> PeerId:
        """Check ``info.compat`` against ours (KVCompatError naming the field on
        mismatch, before anything else) and set up the path to that source.
        Returns the peer id to pass to ``start_read``; connecting again to the
        same worker returns the same id (new reads use the new state; reads in flight
        finish on the old one, which is released after them)."""

    def disconnect(self, peer: PeerId) -> None:
        """Forget ``peer`` (the source left): ``start_read`` on it raises KeyError until
        it is connected again. Reads in flight on it are not cut: they end on their own
        (or by ``abort``), and the peer's state (nixl: its remote agent and descriptors)
        is released when the last of them ends. Unknown peers are a no-op."""
        with self._lock:
            self._peers.drop(peer)

    def num_peers(self) -> int:
        """Peer states held: connected peers plus left or replaced ones that reads in
        flight still use (0 once every peer is disconnected and idle: the leak check)."""
        with self._lock:
            return len(self._peers)

    def _release_peer(self, state: Any) -> None:
        """Free what one peer state holds, once no read uses it (called under ``_lock``,
        from connect, disconnect, close and the end of a read; must not raise). Nothing
        by default: only nixl's states hold resources."""

    @abstractmethod
    def start_read(self, peer: PeerId, plan: ReadPlan) -> ReadHandle:
        """Begin copying ``plan``'s remote blocks into its local blocks.
        Raises ValueError (bad ids) or KeyError (unknown peer) with nothing
        moved; any later failure is reported through the handle's state."""

    @abstractmethod
    def poll(self, handle: ReadHandle) -> TransferState:
        """Advance and report the read; never blocks. Terminal states are final."""

    @abstractmethod
    def abort(self, handle: ReadHandle) -> None:
        """Stop a PENDING read and free its resources; no-op for a finished one.
        Returns at once, without waiting on the transport: the read ends FAILED now
        or shortly after, and bytes may land in its local blocks until it does, so
        poll until it is terminal before those blocks are reused. Local blocks may
        be partly written."""

    def in_flight(self) -> int:
        """Reads started and not yet terminal (0 once idle: the leak check)."""
        with self._lock:
            return len(self._reads)

    @abstractmethod
    def close(self) -> None:
        """Abort reads, disconnect peers, deregister memory. Idempotent."""

    def wait(self, handle: ReadHandle, timeout_s: float) -> TransferState:
        """Poll until terminal or ``timeout_s`` passed; PENDING means timeout
        (the read continues: ``abort`` it or keep polling). Blocks the caller."""
        deadline = time.monotonic() + timeout_s
        pauses = poll_pauses()
        while (state := self.poll(handle)) is TransferState.PENDING:
            if time.monotonic() >= deadline:
                return state
            time.sleep(next(pauses))
        return state

    def __enter__(self) -> KVReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def poll_pauses(longest_s: float = 1e-3) -> Iterator[float]:
    """Pauses between polls of a transfer: none at first (small reads end in
    microseconds), then growing from 50 us to ``longest_s``."""
    pause = 0.0
    while True:
        yield pause
        pause = min(max(pause * 2, 5e-5), longest_s)


def block_view(kv: torch.Tensor) -> torch.Tensor:
    """``kv``'s bytes as ``[num_blocks, block_bytes]`` uint8, sharing memory."""
    return kv.view(torch.uint8).view(kv.shape[0], -1)


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``ids`` into runs of consecutive ids: ``(position, first_id, length)``,
    so a backend can move each run as one region."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, b, 1))
    return runs


@dataclass(frozen=True)
class Backend:
    name: BackendName
    source: type[KVSource]
    reader: type[KVReader]


def get_backend(name: BackendName) -> Backend:
    """The backend ``--kv-transfer NAME`` selects, imported now.

    Raises KVBackendUnavailable for an unknown name or a backend that cannot
    load here (nixl without ``nixl_cu12``). Never falls back silently: the
    caller decides whether to try another backend and logs that it did.
    """
    try:
        return KV_BACKENDS.load(name)
    except RegistryError as e:
        raise KVBackendUnavailable(str(e)) from e
