"""A reader's per-peer state, shared by the reads that use it (every backend's reader keeps
one: the source's address for tcp, its name for local, its NIXL remote agent and
descriptors for nixl).

Connecting a known peer again (a restarted source, a fresh handshake) or disconnecting it
(the source left) *retires* its state: new reads get the new state (or KeyError), reads
already in flight finish on the state they started with, and ``release`` runs once the
last of them has ended, never while one still uses it. This is what keeps a NIXL
re-handshake from freeing remote descriptors under a READ in flight.

Not thread-safe: each reader calls it under its own lock (``KVReader._lock``). Keys are
peer ids (``kvtransfer.base.PeerId``, a str).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

S = TypeVar("S")


@dataclass(eq=False)
class PeerState(Generic[S]):
    """One peer's state and the reads in flight on it."""

    value: S
    reads: int = 0
    live: bool = True
    """False once retired: no new read may start on it."""


class PeerTable(Generic[S]):
    def __init__(self, release: Callable[[S], None] | None = None) -> None:
        """``release(value)``: free what a state holds; runs once per state, when it is
        retired and no read uses it."""
        self._release = release
        self._live: dict[str, PeerState[S]] = {}
        self._retired: set[PeerState[S]] = set()

    def get(self, peer: str) -> S | None:
        entry = self._live.get(peer)
        return None if entry is None else entry.value

    def __getitem__(self, peer: str) -> S:
        """The peer's current state; KeyError naming it when it is not connected."""
        return self._entry(peer).value

    def set(self, peer: str, value: S) -> None:
        """``value`` is the peer's state from now on; the previous one is retired."""
        old, self._live[peer] = self._live.get(peer), PeerState(value)
        if old is not None:
            self._retire(old)

    def drop(self, peer: str) -> None:
        """Forget ``peer`` (its state is retired); unknown peers are a no-op."""
        old = self._live.pop(peer, None)
        if old is not None:
            self._retire(old)

    def begin(self, peer: str) -> PeerState[S]:
        """A read starts on ``peer``'s current state; KeyError for an unknown peer. Pair
        with exactly one ``end``."""
        entry = self._entry(peer)
        entry.reads += 1
        return entry

    def end(self, entry: PeerState[S]) -> None:
        """A read that ``begin`` started has ended (terminal, nothing of it in flight)."""
        entry.reads -= 1
        if not entry.live and entry.reads == 0:
            self._retired.discard(entry)
            self._free(entry)

    def clear(self) -> None:
        """Retire every peer (reads still in flight keep theirs until they end)."""
        for peer in list(self._live):
            self.drop(peer)

    def __len__(self) -> int:
        """States held: live peers plus retired states that reads still use (0 once every
        peer left and its reads ended: the leak check)."""
        return len(self._live) + len(self._retired)

    def _entry(self, peer: str) -> PeerState[S]:
        entry = self._live.get(peer)
        if entry is None:
            raise KeyError(f"unknown or disconnected peer {peer!r}")
        return entry

    def _retire(self, entry: PeerState[S]) -> None:
        entry.live = False
        if entry.reads:
            self._retired.add(entry)
        else:
            self._free(entry)

    def _free(self, entry: PeerState[S]) -> None:
        if self._release is not None:
            self._release(entry.value)
