"""The router's view of its workers: channels, health, load and the prefix index
(fed by each worker's KV event stream).

- A worker whose health check fails, or whose requests fail, is unhealthy (gets no
  new work) until it answers again; its part of the prefix index is kept, since a
  blip does not empty a cache. Each new event stream starts with a snapshot that
  replaces what the worker reported before (``reset``), so the index is rebuilt
  after any reconnect, a restart included.
- A worker that discovery no longer lists (a rollout, a readiness blip) drains: it
  gets no new work but keeps its channel until the requests this router sent it
  end, or DRAIN_TIMEOUT_S passes; only then is it dropped (and its index with it).
  Listed again meanwhile, it simply comes back."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.kv import BlockHash
from proto import common_pb2 as common
from auth.grpc_auth import channel as auth_channel
from proto import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.discovery.base import WorkerEndpoint
from router.prefix_index import PrefixIndex, Tier
from tracing.rpc import client_interceptors

log = logging.getLogger(__name__)
HEALTH_PERIOD_S = 1.0
KV_PEERS_REFRESH_S = 30.0
DRAIN_TIMEOUT_S = 600.0
TIERS = frozenset(Tier)
"""The KV event media this router places by (a newer worker's other tiers are skipped)."""


@dataclass(eq=False)
class Worker:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: object
    healthy: bool = False
    worker_id: str = ""
    load: common.WorkerLoad = field(default_factory=common.WorkerLoad)
    inflight: int = 0
    """Requests this router has sent and not yet seen finish (fresher than load)."""
    draining: bool = False
    """Discovery dropped it: no new work; dropped once inflight reaches 0."""
    kv_peers_sent: tuple[float, frozenset[str]] | None = None
    """Decode workers: when this router last told it the prefill pool, and what."""
    refused: bool = False
    """Its last authenticated call was refused (another cluster secret)."""
    loras: dict[str, common.LoRAAdapter] = field(default_factory=dict)
    """The LoRA adapters it serves, by name (WorkerLoad.loras)."""
    lora_generation: int = -1
    """The generation of ``loras`` (a report of an older one is ignored)."""

    @property
    def name(self) -> str:
        return self.worker_id or self.address

    def take_loras(self, message, fresh: bool = False) -> None:
        """Adopt a WorkerLoad's or LoRAReply's adapters unless they are older than what
        it said before; fresh: a new event stream's first batch (the worker may have
        restarted, its count with it)."""
        if fresh or message.lora_generation >= self.lora_generation:
            self.loras = {a.name: a for a in message.loras}
            self.lora_generation = message.lora_generation

    def lora_identity(self, lora: str) -> bytes | None:
        """The identity of the adapter it serves as ``lora`` (b"" for the base model,
        lora ""); None when it serves no adapter of that name."""
        if not lora:
            return b""
        adapter = self.loras.get(lora)
        return adapter.identity if adapter is not None else None


_STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}


class WorkerPool:
    """Workers come and go as discovery says (``apply``); each has a health loop and
    a KV event stream while it is in the pool."""

    def __init__(self, secret: bytes, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.secret = secret
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self.index = PrefixIndex()
        self.workers: list[Worker] = []
        self.drain_timeout_s = drain_timeout_s
        self._tasks: dict[Worker, list[asyncio.Task]] = {}
        self._drains: dict[Worker, asyncio.Task] = {}

    def healthy(self, role: str) -> list[Worker]:
        """Workers that may take new work."""
        return [w for w in self.workers if w.role == role and w.healthy and not w.draining]

    def has_decode_room(self, blocks: int) -> bool:
        """Some healthy decode worker reported at least this many free KV blocks (or has
        not reported yet). With no healthy decode worker at all, True: the request
        goes on and gets its 503 now instead of waiting in the queue."""
        decoders = self.healthy("decode")
        return not decoders or any(not w.load.total_blocks or w.load.free_blocks >= blocks
                                   for w in decoders)

    def all(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    async def apply(self, endpoints: frozenset[WorkerEndpoint]) -> None:
        """Make the pool exactly these endpoints."""
        have = {WorkerEndpoint(w.role, w.address): w for w in self.workers}  # type: ignore[arg-type]
        for ep in endpoints & have.keys():
            w = have[ep]
            if w.draining:  # listed again before its drain ended
                w.draining = False
                self._drains.pop(w).cancel()
                log.info("%s worker %s is listed again", w.role, w.address)
        for ep in endpoints - have.keys():
            ch = auth_channel(ep.address, self.secret, interceptors=client_interceptors())
            w = Worker(ep.address, ep.role, ch, _STUBS[ep.role](ch))
            self.workers.append(w)
            self._tasks[w] = [asyncio.create_task(self._watch_events(w)),
                              asyncio.create_task(self._watch_health(w))]
            log.info("%s worker %s joined the pool", ep.role, ep.address)
        for ep in have.keys() - endpoints:
            w = have[ep]
            if not w.draining:
                w.draining = True
                self._drains[w] = asyncio.create_task(self._drain(w))
                log.info("%s worker %s left discovery; draining %d requests", w.role,
                         w.address, w.inflight)

    async def _drain(self, w: Worker) -> None:
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        while w.inflight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        self._drains.pop(w, None)
        await self._drop(w)

    async def _drop(self, w: Worker) -> None:
        if w not in self.workers:
            return
        self.workers.remove(w)
        tasks = self._tasks.pop(w, [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.index.drop_worker(w.address)
        await w.channel.close()
        log.info("%s worker %s left the pool", w.role, w.address)

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(w.healthy for w in self.workers):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for t in self._drains.values():
            t.cancel()
        self._drains.clear()
        for w in list(self.workers):
            await self._drop(w)

    async def _watch_health(self, w: Worker) -> None:
        stub = health_pb2_grpc.HealthStub(w.channel)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                ok = r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                ok = False
            # the health service is open to probes; an authenticated call proves the
            # worker shares this router's cluster secret
            ok = ok and await self._authenticated_load(w)
            if ok and w.role == "decode":
                ok = await self._announce_prefill_pool(w)  # before it gets any handle
            self._set_health(w, ok)
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _authenticated_load(self, w: Worker) -> bool:
        """GetLoad with this router's credentials: refreshes w.load; False (with one
        clear warning) when the worker refuses them."""
        try:
            w.load = await w.stub.GetLoad(common.LoadRequest(), timeout=2.0)
            w.take_loras(w.load)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                if not w.refused:
                    # the details name the binding that failed and the flag that fixes it
                    log.warning("%s worker %s refuses this router's credentials: %s", w.role,
                                w.name, e.details())
                w.refused = True
            return False
        w.refused = False
        return True

    async def _announce_prefill_pool(self, w: Worker) -> bool:
        """Tell a decode worker which prefill workers it may pull KV from (on a change,
        and every KV_PEERS_REFRESH_S); False when it refuses (wrong cluster secret)."""
        pool = frozenset(p.address for p in self.workers if p.role == "prefill")
        now = time.monotonic()
        sent = w.kv_peers_sent
        if sent is not None and sent[1] == pool and now - sent[0] < KV_PEERS_REFRESH_S:
            return True
        try:
            await w.stub.SetKVPeers(decode_pb2.KVPeers(router_id=self.router_id,
                                                       prefill_endpoints=sorted(pool)),
                                    timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.warning("decode worker %s refused the prefill pool: %s %s", w.name,
                        e.code().name, e.details())
            return False
        w.kv_peers_sent = (now, pool)
        return True

    def mark_down(self, w: Worker) -> None:
        """A request saw this worker fail: out of the pool until its health check passes."""
        self._set_health(w, False)

    def _set_health(self, w: Worker, ok: bool) -> None:
        if ok != w.healthy:
            log.log(logging.INFO if ok else logging.WARNING, "%s worker %s is %s", w.role,
                    w.name, "up" if ok else "DOWN")
        w.healthy = ok

    async def _watch_events(self, w: Worker) -> None:
        delay = 0.1
        while True:
            try:
                # subscriber: who we are, so a prefill worker can tell when we are gone
                async for batch in w.stub.StreamKVEvents(
                        common.KVEventsRequest(subscriber=self.router_id)):
                    delay = 0.1
                    if batch.reset:  # a fresh snapshot: what it said before is void
                        self.index.drop_worker(w.address)
                    w.worker_id = batch.worker_id
                    if batch.HasField("load"):
                        w.load = batch.load
                        w.take_loras(batch.load, fresh=batch.reset)
                    for e in batch.events:
                        if e.medium not in TIERS:  # a tier this router does not know
                            continue
                        if e.kind == common.KVEvent.STORED:
                            self.index.stored(w.address, BlockHash(e.block_hash), Tier(e.medium))
                        else:
                            self.index.removed(w.address, BlockHash(e.block_hash), Tier(e.medium))
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(delay)  # the next stream's snapshot resets the index
            delay = min(delay * 2, 2.0)
