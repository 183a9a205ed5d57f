"""A reader's reads in flight: started, not yet ended, each pinning the peer state it began on.

Every backend's reader keeps one (``KVReader._reads``) beside its PeerTable, and every read
goes through it: ``start`` when the read begins, ``end`` exactly once when it becomes
terminal, whoever gets there first (the read itself, ``abort``, ``close``).

Threads: not thread-safe, and nothing here blocks. The reader calls every method under its
own ``_lock`` (the lock that also guards the PeerTable), from whichever thread ends the read:
the caller's (nixl's ``poll``/``abort``/``close``, local's ``start_read``) or a transport
thread (tcp's pool threads).

What ``end`` frees, in order: the read's transport resources, through the ``free_read`` hook
(nixl: its NIXL request, whose release aborts an unfinished READ); then the read's pin on its
peer state (``PeerTable.end``), which frees a replaced or disconnected peer's state once its
last read has ended. A read whose transport could not let go keeps its pin (the transport
may still use the peer's descriptors): its peer state then stays held until the reader goes.

Who waits for whom: nobody, here. ``abort`` and ``close`` end what they can at once and cut
the rest; a transport thread that is still moving bytes ends its read when it lets go, and
``close`` is the one that waits for those threads (tcp's pool). Until a read is terminal its
local blocks may still be written.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from kvtransfer.base import PeerId, ReadHandle, ReadPlan, TransferState
from kvtransfer.peer_table import PeerState, PeerTable

S = TypeVar("S")

FreeRead = Callable[[ReadHandle], Exception | None]
"""``free_read(handle) -> None | error``: let go of the read's transport resources (called
once, by ``end``). An error means the transport could not let go: the read ends FAILED with
it (unless it already had an error) and keeps its peer state pinned."""


class InFlightReads(Generic[S]):
    def __init__(self, peers: PeerTable[S], free_read: FreeRead | None = None) -> None:
        self._peers = peers
        self._free_read = free_read
        self._reads: dict[ReadHandle, PeerState[S]] = {}
        """Each read in flight -> the peer state it started on (pinned until it ends)."""

    def start(self, peer: PeerId, plan: ReadPlan, block_bytes: int, impl: Any = None) -> ReadHandle:
        """A PENDING read of ``plan`` (blocks of ``block_bytes``) from ``peer``'s current
        state, pinned to that state; KeyError naming the peer when it is not connected
        (nothing is recorded then)."""
        entry = self._peers.begin(peer)
        handle = ReadHandle(peer, plan, plan.num_blocks * block_bytes, impl=impl)
        self._reads[handle] = entry
        return handle

    def peer_state(self, handle: ReadHandle) -> S:
        """The peer state ``handle`` started on (not necessarily the peer's current one)."""
        return self._reads[handle].value

    def end(self, handle: ReadHandle, state: TransferState, error: Exception | None = None) -> bool:
        """Make ``handle`` terminal with ``state`` and free what it holds (module
        docstring). Each read ends once: False, and nothing changes, when it already
        has (an abort racing the read's own end)."""
        entry = self._reads.pop(handle, None)
        if entry is None:
            return False
        stuck = self._free_read(handle) if self._free_read is not None else None
        if stuck is not None:
            state, error = TransferState.FAILED, error or stuck
        handle.finish(state, error)
        if stuck is None:
            self._peers.end(entry)
        return True

    def pending(self) -> list[ReadHandle]:
        """The reads in flight now (a copy: ending them while iterating is fine)."""
        return list(self._reads)

    def __len__(self) -> int:
        """Reads in flight (0 once idle: the leak check)."""
        return len(self._reads)
