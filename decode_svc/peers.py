"""The decode worker's links to prefill workers: one KVLink client and one reader
connection per source endpoint, shared by every pull from it.

A failed pull must not tear down a link other pulls are using: ``invalidate``
takes the link out of the cache (the next request handshakes afresh, which also
picks up a restarted source's new agent metadata) and the old one is closed when
its last user lets go. Handshakes to different endpoints run concurrently; two
requests to one new endpoint share one handshake.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from kvtransfer.base import CompatRecord, KVReader, PeerId
from kvtransfer.link import KVLinkClient


@dataclass(eq=False)
class Peer:
    endpoint: str
    client: KVLinkClient
    peer_id: PeerId
    users: int = 0
    stale: bool = False


@dataclass
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    peer: Peer | None = None


class PeerCache:
    def __init__(self, reader: KVReader, compat: Callable[[], CompatRecord], reader_id: str,
                 backend: str, secret: bytes) -> None:
        self._secret = secret
        self._reader = reader
        self._compat = compat
        self._reader_id = reader_id
        self._backend = backend
        self._slots: dict[str, _Slot] = {}

    @asynccontextmanager
    async def use(self, endpoint: str) -> AsyncIterator[Peer]:
        """The link to endpoint for the duration of one request's handoff. Raises
        KVCompatError when the two workers' KV records differ, and the transport's
        error when the endpoint cannot be reached."""
        peer = await self._get(endpoint)
        peer.users += 1
        try:
            yield peer
        finally:
            peer.users -= 1
            if peer.stale and peer.users == 0:
                await peer.client.close()

    def invalidate(self, peer: Peer) -> None:
        """This link failed: new requests handshake again; its users finish on it."""
        slot = self._slots.get(peer.endpoint)
        if slot is not None and slot.peer is peer:
            slot.peer = None
        peer.stale = True

    async def _get(self, endpoint: str) -> Peer:
        slot = self._slots.setdefault(endpoint, _Slot())
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
                slot.peer = Peer(endpoint, client, peer_id)
            return slot.peer

    async def close(self) -> None:
        for slot in self._slots.values():
            if slot.peer is not None:
                await slot.peer.client.close()
        self._slots.clear()


class KVPeerList:
    """Which sources this decode worker pulls KV from: the explicit --kv-peer list, plus
    each router's last pushed prefill pool (SetKVPeers) while it is fresh."""

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
        live = [eps for t, eps in self._by_router.values() if now - t < self.TTL_S]
        return self._explicit.union(*live)

    def allows(self, endpoint: str) -> bool:
        return endpoint in self.current()
