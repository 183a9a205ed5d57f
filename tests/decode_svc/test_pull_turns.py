"""Pull turns (PeerCache.turn): a source's pulls queue behind its own PULLS_PER_SOURCE,
most important first, and a busy source never holds every overall turn."""
from __future__ import annotations

import asyncio

from decode_svc.peers import PULLS_IN_ALL, PULLS_PER_SOURCE, Peer, PeerCache
from decode_svc.priority_gate import PriorityGate


def _peer(name: str) -> Peer:
    return Peer(name, client=None, peer_id=name, gate=PriorityGate(PULLS_PER_SOURCE))  # type: ignore[arg-type]


async def _settle() -> None:
    """Let every task that can run, run (no timing involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_stuck_source_queues_only_its_own_pulls_in_priority_order() -> None:
    async def body() -> None:
        cache = PeerCache(None, None, "d", "tcp", b"s", frozenset)  # type: ignore[arg-type]
        assert (PULLS_PER_SOURCE, PULLS_IN_ALL) == (2, 4)  # the numbers this test walks through
        hung, ok, third = _peer("hung"), _peer("ok"), _peer("third")
        release: dict[str, asyncio.Event] = {}
        entered: list[str] = []

        async def pull(peer: Peer, name: str, priority: int) -> None:
            release[name] = asyncio.Event()
            async with cache.turn(peer, priority):
                entered.append(name)
                await release[name].wait()

        tasks = [asyncio.ensure_future(pull(hung, f"hung{i}", 5)) for i in range(2)]
        tasks += [asyncio.ensure_future(pull(hung, "hung-low", 9)),
                  asyncio.ensure_future(pull(hung, "hung-high", 0))]
        await _settle()
        assert entered == ["hung0", "hung1"]  # the rest wait for the hung source's turns
        tasks += [asyncio.ensure_future(pull(ok, f"ok{i}", 5)) for i in range(2)]
        tasks += [asyncio.ensure_future(pull(third, "third", 5))]
        await _settle()
        assert entered == ["hung0", "hung1", "ok0", "ok1"]  # other sources go on...
        release["ok0"].set()
        await _settle()
        assert entered[-1] == "third"  # ...up to PULLS_IN_ALL at once
        release["hung0"].set()
        await _settle()
        assert entered[-1] == "hung-high"  # most important first within a source
        for event in list(release.values()):
            event.set()
        await asyncio.gather(*tasks)
        assert entered[-1] == "hung-low"
        assert (hung.gate.holders, ok.gate.holders, cache._all.holders) == (0, 0, 0)
    asyncio.run(asyncio.wait_for(body(), 30))
