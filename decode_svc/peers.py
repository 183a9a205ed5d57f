"""The decode worker's links to prefill workers: one KVLink client, one reader connection
and one pull gate per source endpoint, shared by every pull from it.

A failed pull must not tear down a link other pulls are using: ``invalidate``
takes the link out of the cache (the next request handshakes afresh, which also
picks up a restarted source's new agent metadata) and the old one is closed when
its last user lets go. Handshakes to different endpoints run concurrently; two
requests to one new endpoint share one handshake.

Pulls are gated per source (``turn``): at most PULLS_PER_SOURCE at once from one
endpoint, most important first, then at most PULLS_IN_ALL overall. A source whose
reads hang (until --transfer-timeout-s) holds only its own endpoint's turns and
PULLS_PER_SOURCE of the overall ones, so pulls from every other source go on.

Nothing is kept for a source that left: an endpoint's slot (link, gate) goes when no
request uses it and either its link was invalidated or no list names it any more
(``listed``: a router's SetKVPeers dropped it, or that router's list expired); the
reader forgets the source (``KVReader.disconnect``) when its last link closes. Never
while a pull uses them: a request inside ``use`` keeps its endpoint's slot.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from decode_svc.priority_gate import PriorityGate
from kvtransfer.base import CompatRecord, KVReader, PeerId
from kvtransfer.link import KVLinkClient

PULLS_PER_SOURCE = 2
PULLS_IN_ALL = 4
"""Larger than PULLS_PER_SOURCE, so one hung source never holds every turn (and equal
to the TCP reader's read threads, which would queue the rest anyway)."""


@dataclass(eq=False)
class Peer:
    endpoint: str
    client: KVLinkClient
    peer_id: PeerId
    gate: PriorityGate
    """Its endpoint's pull gate (shared with the links that replace this one)."""
    users: int = 0
    stale: bool = False


@dataclass(eq=False)
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    gate: PriorityGate = field(default_factory=lambda: PriorityGate(PULLS_PER_SOURCE))
    peer: Peer | None = None
    users: int = 0
    """Requests inside ``use`` for this endpoint, on any of its links or handshaking."""


class PeerCache:
    def __init__(self, reader: KVReader, compat: Callable[[], CompatRecord], reader_id: str,
                 backend: str, secret: bytes, listed: Callable[[], frozenset[str]]) -> None:
        """``listed``: the endpoints this worker may pull from now (KVPeerList.current);
        slots of others are dropped once idle."""
        self._secret = secret
        self._reader = reader
        self._compat = compat
        self._reader_id = reader_id
        self._backend = backend
        self._listed = listed
        self._slots: dict[str, _Slot] = {}
        self._all = PriorityGate(PULLS_IN_ALL)
        self._links: Counter[PeerId] = Counter()
        """Open links per reader peer id: the reader forgets a peer when its last closes."""

    def __len__(self) -> int:
        """Endpoints with a slot (0 once every source left and its pulls ended)."""
        return len(self._slots)

    @asynccontextmanager
    async def use(self, endpoint: str) -> AsyncIterator[Peer]:
        """The link to endpoint for the duration of one request's handoff. Raises
        KVCompatError when the two workers' KV records differ, and the transport's
        error when the endpoint cannot be reached."""
        await self.prune()
        slot = self._slots.setdefault(endpoint, _Slot())
        slot.users += 1
        try:
            peer = await self._get(slot, endpoint)
            peer.users += 1
            try:
                yield peer
            finally:
                peer.users -= 1
                if peer.stale and peer.users == 0:
                    await self._close(peer)
        finally:
            slot.users -= 1
            if slot.users == 0 and (slot.peer is None or endpoint not in self._listed()):
                await self._drop(endpoint, slot)

    @asynccontextmanager
    async def turn(self, peer: Peer, priority: int) -> AsyncIterator[None]:
        """A pull's turn: one of its source's PULLS_PER_SOURCE, then one of PULLS_IN_ALL,
        lower priority values first in each (in that order, so a request waiting on a
        busy or hung source holds no overall turn)."""
        async with peer.gate.hold(priority), self._all.hold(priority):
            yield

    def invalidate(self, peer: Peer) -> None:
        """This link failed: new requests handshake again; its users finish on it."""
        slot = self._slots.get(peer.endpoint)
        if slot is not None and slot.peer is peer:
            slot.peer = None
        peer.stale = True

    async def prune(self) -> None:
        """Drop the idle slots of endpoints no list names any more."""
        listed = self._listed()
        for endpoint, slot in list(self._slots.items()):
            if slot.users == 0 and endpoint not in listed:
                await self._drop(endpoint, slot)

    async def _get(self, slot: _Slot, endpoint: str) -> Peer:
        async with slot.lock:
            if slot.peer is None:
                client = KVLinkClient(endpoint, self._reader_id, self._secret)
                try:
                    info = await client.handshake(self._compat(), self._backend)
                    self._compat().check(info.compat)
                    peer_id = self._reader.connect(info)
                except BaseException:
                    await client.close()
                    raise
                self._links[peer_id] += 1
                slot.peer = Peer(endpoint, client, peer_id, slot.gate)
            return slot.peer

    async def _drop(self, endpoint: str, slot: _Slot) -> None:
        if self._slots.get(endpoint) is slot:
            del self._slots[endpoint]
        if slot.peer is not None:
            peer, slot.peer = slot.peer, None
            await self._close(peer)

    async def _close(self, peer: Peer) -> None:
        self._links[peer.peer_id] -= 1
        if self._links[peer.peer_id] == 0:
            del self._links[peer.peer_id]
            self._reader.disconnect(peer.peer_id)
        await peer.client.close()

    async def close(self) -> None:
        for endpoint, slot in list(self._slots.items()):
            await self._drop(endpoint, slot)


class KVPeerList:
    """Which sources this decode worker pulls KV from: the explicit --kv-peer list, plus
    each router's last pushed prefill pool (SetKVPeers) while it is fresh. A router's
    list is deleted once it expired (the router left)."""

    TTL_S = 120.0

    def __init__(self, explicit: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._explicit = frozenset(explicit)
        self._by_router: dict[str, tuple[float, frozenset[str]]] = {}
        self._clock = clock

    def update(self, router_id: str, endpoints: list[str]) -> int:
        self._by_router[router_id] = (self._clock(), frozenset(endpoints))
        return len(self.current())

    def current(self) -> frozenset[str]:
        now = self._clock()
        for router, (t, _) in list(self._by_router.items()):
            if now - t >= self.TTL_S:
                del self._by_router[router]
        return self._explicit.union(*(eps for _, eps in self._by_router.values()))

    def routers(self) -> frozenset[str]:
        """Routers whose list is fresh."""
        self.current()
        return frozenset(self._by_router)

    def allows(self, endpoint: str) -> bool:
        return endpoint in self.current()
