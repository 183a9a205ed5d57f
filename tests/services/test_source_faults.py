"""KV sources that hang or leave, seen from the decode worker: a hung source stalls only
its own pulls (pulls are gated per source), and nothing is kept for a source that left
(its link slot, the reader's peer state, an expired router's list), never while a pull
still uses it. Each test ends with the leak check."""
from __future__ import annotations

import asyncio
import threading

import pytest

from decode_svc.peers import KVPeerList
from kvtransfer.link import KVLinkClient
from proto import common_pb2, decode_pb2, kv_link_pb2
from tests.services.conftest import (disagg, kv_endpoint, leak_check, prefill_worker, sampling,
                                     services, until)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % 300 + 3 for i in range(n)]


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 180))


class StalledReads:
    """A TCP source that takes read requests and answers none until ``release`` is set;
    then it refuses them (the pulls fail, the prompts are recomputed)."""

    def __init__(self, source) -> None:
        self.reached = 0
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._refuse = source._refuse

        def serve_one(conn, request) -> None:
            with self._lock:
                self.reached += 1
            self.release.wait(120)
            self._refuse(conn, kv_link_pb2.READ_INTERNAL, "stalled source released")
        source._serve_one = serve_one  # this source only (an instance attribute)


def held(d) -> tuple[int, int, int]:
    """What the decode worker keeps per source: link slots, reader peer states, and
    router lists."""
    return len(d.peers), d.reader.num_peers(), len(d.kv_peers.routers())


def test_a_hung_source_stalls_only_its_own_pulls(tiny_model_dir, reference) -> None:
    """Three requests pull from a source that never answers; one from a healthy source
    then completes its pull (exact tokens, lease released) while the hung source still
    holds its reads. Before, one pull gate of two served every source: the two hung
    pulls held it until they timed out, and the healthy lease waited behind them."""
    async def body():
        async with services(tiny_model_dir, transfer_timeout_s=120) as (p, d, ps, ds), \
                prefill_worker(tiny_model_dir, lease_ttl_s=120) as (hung, hs):
            d.kv_peers = KVPeerList((kv_endpoint(p), kv_endpoint(hung)))
            stall = StalledReads(hung.source)
            prompts = {f"stuck{i}": _prompt(40, i) for i in range(3)}
            stuck = [asyncio.ensure_future(disagg(hs, ds, rid, pr, sampling()))
                     for rid, pr in prompts.items()]
            await until(lambda: stall.reached == 2, "two reads at the hung source")
            prompt = _prompt(40, 9)
            toks, chunks = await asyncio.wait_for(disagg(ps, ds, "healthy", prompt, sampling()),
                                                  90)
            assert toks == reference(prompt, 8)
            trace = chunks[0].trace
            assert trace.fallback == decode_pb2.FALLBACK_REASON_UNSPECIFIED
            assert trace.blocks_pulled == 3 and trace.lease_ended
            assert p.leases.active() == 0
            # the hung source still holds two reads; the third waits for its source's turn
            assert d.reader.in_flight() == 2 and stall.reached == 2
            assert not any(t.done() for t in stuck)
            stall.release.set()
            for (rid, pr), task in zip(prompts.items(), stuck):
                toks, chunks = await task
                assert toks == reference(pr, 8), rid
                assert chunks[0].trace.fallback == decode_pb2.FALLBACK_TRANSFER_FAILED, rid
            assert stall.reached == 3 and d.reader.in_flight() == 0
            await leak_check(p, hung, d)
    _run(body())


async def _push(ds, router: str, endpoints: list[str]) -> None:
    await ds.SetKVPeers(decode_pb2.KVPeers(router_id=router, prefill_endpoints=endpoints))


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_nothing_is_kept_for_a_source_that_left(tiny_model_dir, reference, backend,
                                                monkeypatch) -> None:
    """A source leaves when no router lists it any more (a push without it, or the
    router's list expired) or when its link failed and is not used again; then the decode
    worker holds nothing for it. A pull in progress keeps what it uses until it ends."""
    if backend == "nixl":
        pytest.importorskip("nixl_cu12", reason="nixl_cu12 is not installed")
    in_pull, go_on = asyncio.Event(), asyncio.Event()
    orig = KVLinkClient.pull

    async def pull(self, reader, peer, plan, timeout_s=30.0):
        if plan.request_id == "slow":
            in_pull.set()
            await go_on.wait()
        if plan.request_id == "broken":
            raise RuntimeError("malformed reply (injected)")
        return await orig(self, reader, peer, plan, timeout_s)
    monkeypatch.setattr(KVLinkClient, "pull", pull)
    now = [0.0]

    async def body():
        async with services(tiny_model_dir, backend=backend) as (p, d, ps, ds):
            async def handoff(rid: str, seed: int) -> decode_pb2.KVTrace:
                prompt = _prompt(40, seed)
                toks, chunks = await disagg(ps, ds, rid, prompt, sampling())
                assert toks == reference(prompt, 8), rid
                return chunks[0].trace

            ep = kv_endpoint(p)
            d.kv_peers = KVPeerList(clock=lambda: now[0])  # routers' lists only
            await _push(ds, "r1", [ep])
            await _push(ds, "r2", [ep])
            assert (await handoff("a", 1)).blocks_pulled == 3
            assert held(d) == (1, 1, 2)
            await _push(ds, "r1", [])  # r2 still lists it
            assert held(d) == (1, 1, 2)
            now[0] += KVPeerList.TTL_S + 1  # r2 went away; r1 pushes again
            await _push(ds, "r1", [])
            assert held(d) == (0, 0, 1)

            # dropped from the list mid-pull: kept until that pull ends
            await _push(ds, "r1", [ep])
            slow = asyncio.ensure_future(handoff("slow", 2))
            await asyncio.wait_for(in_pull.wait(), 60)
            await _push(ds, "r1", [])
            assert held(d) == (1, 1, 1)
            go_on.set()
            assert (await slow).blocks_pulled == 3
            assert held(d) == (0, 0, 1)

            # a link that failed and is not used again
            await _push(ds, "r1", [ep])
            assert (await handoff("broken", 3)).fallback == decode_pb2.FALLBACK_TRANSFER_FAILED
            await ps.Abort(common_pb2.AbortRequest(request_id="broken"))  # its lease, as a router would
            assert held(d) == (0, 0, 1)
            assert (await handoff("again", 4)).blocks_pulled == 3  # handshakes afresh
            assert held(d) == (1, 1, 1)
            await leak_check(p, d)
    _run(body())
