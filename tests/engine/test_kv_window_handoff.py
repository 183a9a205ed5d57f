"""A request whose prompt KV is loaded from elsewhere (a KV connector, e.g. the P/D
handoff) into an engine whose model slides: only the blocks its window will read are
allocated and loaded; a failed load recomputes the whole prompt; nothing is registered
in the prefix cache past a block that was never here."""
from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.kv_cache.manager import NULL_BLOCK
from engine.kv_connector import ExternalKV, KVConnector
from engine.scheduler import Scheduler
from tests.engine.test_kv_window import BS, WINDOW, FakeModel, _req


class Loads(KVConnector):
    """Records where each load must land (the engine tests' stand-in for a transfer)."""

    def __init__(self) -> None:
        self.fills: dict[str, tuple[int, list[tuple[int, int]]]] = {}

    def external_kv(self, req):
        return req.kv_transfer if isinstance(req.kv_transfer, ExternalKV) else None

    def blocks_allocated(self, req, num_local_tokens, fill) -> None:
        self.fills[req.request_id] = (num_local_tokens, fill)

    def load_ended(self, req) -> None:
        req.kv_transfer = None


def _setup(window: int | None, num_blocks: int = 200):
    kv = KVCacheManager(num_blocks, BS, sliding_window=window)
    conn = Loads()
    return kv, conn, Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64), connector=conn)


def _run(sched: Scheduler, model: FakeModel, steps: int) -> None:
    for _ in range(steps):
        model.step(sched, sched.schedule())
        for r in list(sched.running):
            if len(r.token_ids) - len(r.prompt_token_ids) >= r.params.max_tokens:
                sched.remove(r)


@pytest.mark.parametrize("loaded", [True, False])
def test_a_load_moves_only_the_window(loaded: bool) -> None:
    """1,000 prompt tokens of KV from elsewhere, 160 of them cached here: the load fills
    the 17 blocks of the first local query's window (not 53, not the hit's first blocks);
    the loaded request then decodes with every visible key right; a failed load
    recomputes the prompt from its first token; no leak."""
    kv, conn, sched = _setup(WINDOW)
    model = FakeModel(WINDOW)
    local = _req("local", range(160), max_tokens=1)
    sched.add(local)
    _run(sched, model, 10)  # computed here, 10 blocks cached
    req = _req("x", list(range(160)) + list(range(500, 1341)), max_tokens=50)
    req.kv_transfer = ExternalKV(1000)
    sched.add(req)
    sched.schedule()
    n_local, fill = conn.fills["x"]
    first = (1000 - WINDOW + 1) // BS
    assert n_local == 160 and [i for i, _ in fill] == list(range(first, 63))
    table = kv.table("x")
    assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
    assert kv.pool.num_free == 200 - len(table[first:])  # the hit's blocks not adopted
    if loaded:
        for pos in range(first * BS, 1000):  # the bytes land in the filled blocks
            model.device[(table[pos // BS], pos % BS)] = ("x", pos)
    sched.activate(req, loaded)
    assert req.num_computed_tokens == (1000 if loaded else 0)
    _run(sched, model, 120)
    assert not sched.has_work()
    kv.leak_check()


def test_a_load_without_a_window_moves_every_missing_block() -> None:
    kv, conn, sched = _setup(None)
    req = _req("x", range(1001), max_tokens=1)
    req.kv_transfer = ExternalKV(1000)
    sched.add(req)
    sched.schedule()
    assert [i for i, _ in conn.fills["x"][1]] == list(range(63))
    sched.activate(req, False)
    sched.remove(req)
    kv.leak_check()


def test_no_hash_is_registered_past_a_block_that_was_never_here() -> None:
    """A loaded request's blocks before its window never arrived: it registers none of
    its later blocks (a chain with a hole is never hit, so no event announces one)."""
    kv, conn, sched = _setup(WINDOW)
    req = _req("x", range(1001), max_tokens=1)
    req.kv_transfer = ExternalKV(1000)
    sched.add(req)
    sched.schedule()
    sched.activate(req, True)
    assert kv.pool.drain_events() == [] and kv.find_cached_prefix(_req("y", range(1001))) == []
    sched.remove(req)
    kv.leak_check()
