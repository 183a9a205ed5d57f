"""A router's leases end soon after the router is gone (prefill_svc/router_leases.py):
a router killed between a prefill's reply and its decode call used to leave the blocks
pinned until the lease's TTL (30 s; the chaos audit waited it out)."""
from __future__ import annotations

import asyncio

from auth.grpc_auth import channel as auth_channel
from prefill_svc.router_leases import RouterLeases
from proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.services.conftest import leak_check, prefill_worker, prompt_ids, sampling, until

BOUND_S = 30.0
GONE_S = 0.5


class _Router:
    """A router's two links to a prefill worker: its KV event stream and its Prefill calls,
    over one channel of its own (closing it is what the worker sees when it dies)."""

    def __init__(self, p, name: str) -> None:
        self.name = name
        self.channel = auth_channel(f"127.0.0.1:{p.port}", p.secret)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.events = None

    async def subscribe(self) -> None:
        self.events = self.stub.StreamKVEvents(common_pb2.KVEventsRequest(subscriber=self.name))
        await asyncio.wait_for(self.events.read(), BOUND_S)  # the snapshot: it is open

    async def prefill(self, rid: str, router_id: str | None = None):
        reply = await self.stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=prompt_ids(40, len(rid)), sampling=sampling(8),
            router_id=self.name if router_id is None else router_id), timeout=BOUND_S)
        assert reply.HasField("kv_handle"), "the prefill leased nothing"
        return reply


def test_a_dead_routers_leases_end_and_a_reconnecting_routers_stay(tiny_model_dir) -> None:
    async def body():
        async with prefill_worker(tiny_model_dir) as (p, stub):
            p.routers.gone_after_s = GONE_S
            dead, live = _Router(p, "router-dead"), _Router(p, "router-live")
            for r in (dead, live):
                await r.subscribe()
            await dead.prefill("d1")
            await dead.prefill("d2")
            kept = await live.prefill("l1")
            anonymous = await live.prefill("a1", router_id="")  # no id: the TTL alone
            assert p.leases.active() == 4
            assert (p.routers.held("router-dead"), p.routers.held("router-live")) == (2, 1)

            # the live router's stream breaks and comes back within the grace
            live.events.cancel()
            await asyncio.sleep(GONE_S / 5)
            await live.subscribe()
            # the dead router's process goes: its connection closes
            await dead.channel.close()
            took = await until(lambda: p.leases.active() == 2, "down to 2 leases")
            assert took >= GONE_S * 0.8, f"ended {took:.2f} s after the close, before the grace"
            await asyncio.sleep(GONE_S * 2)  # the live router's countdown was cancelled
            assert p.leases.active() == 2 and p.routers.held("router-live") == 1

            for reply in (kept, anonymous):  # a decode worker would Release them
                await stub.Abort(common_pb2.AbortRequest(request_id=reply.request_id))
            await live.channel.close()
            await leak_check(p)  # every block of the dead router's prefills is free
            await asyncio.sleep(0.3)  # one reaper pass forgets the ended leases
            assert (p.routers.held("router-dead"), p.routers.held("router-live")) == (0, 0)
    asyncio.run(asyncio.wait_for(body(), 120))


def test_leases_ended_elsewhere_are_forgotten_and_an_unknown_close_is_ignored() -> None:
    async def body():
        ended = []
        live = {("r1", 1)}
        def end(rid, epoch, why):
            ended.append((rid, epoch, why))
            return True
        routers = RouterLeases(end, gone_after_s=0.05)
        routers.closed("never-opened")  # a stream from a subscriber never counted
        routers.opened("a")
        routers.granted("a", "r1", 1)
        routers.granted("a", "r2", 2)
        routers.granted("", "r3", 3)  # no router named: not tracked
        routers.prune(lambda rid, epoch: (rid, epoch) in live)
        assert routers.held("a") == 1 and routers.held("") == 0
        routers.opened("a")  # two streams: both must close
        routers.closed("a")
        await asyncio.sleep(0.1)
        assert ended == []
        routers.closed("a")
        await asyncio.sleep(0.1)
        assert ended == [("r1", 1, "router a is gone")] and routers.held("a") == 0
    asyncio.run(body())


class _Events:
    """A worker stub whose KV event stream records who subscribed and ends at once."""

    def __init__(self) -> None:
        self.subscribers: list[str] = []

    def StreamKVEvents(self, req):
        self.subscribers.append(req.subscriber)

        async def none():
            return
            yield
        return none()


def test_the_router_subscribes_under_the_id_its_prefills_carry() -> None:
    """The pool's KV event streams name the router as its Prefill calls do
    (tests/router/test_flow.py checks the calls carry pool.router_id)."""
    from router.workers import Worker, WorkerPool

    async def body():
        pool, stub = WorkerPool(b"secret"), _Events()
        w = Worker("127.0.0.1:9", "prefill", None, stub, healthy=True)
        task = asyncio.create_task(pool._watch_events(w))
        await until(lambda: stub.subscribers, "subscribed")
        task.cancel()
        assert stub.subscribers[0] == pool.router_id and pool.router_id.startswith("router-")
    asyncio.run(body())
