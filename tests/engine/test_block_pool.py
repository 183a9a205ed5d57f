"""Block pool, chained hashes and the KV manager's prefix-cache bookkeeping."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv_cache import BlockPool, KVCacheManager, KVEventKind
from core.kv import hash_token_blocks, root_hash
from engine.request import Request
from core.sampling import SamplingParams


def test_refcounts_lru_and_leak_check() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2  # all or nothing
    pool.touch([a[0]])
    pool.free(a)
    assert pool.blocks[a[0]].ref_cnt == 1 and pool.num_free == 3
    with pytest.raises(AssertionError, match="KV leak"):
        pool.leak_check()
    pool.free([a[0]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])
    pool.leak_check()


def test_cached_blocks_survive_until_evicted_lru() -> None:
    pool = BlockPool(3)
    h = hash_token_blocks(list(range(8)), 4, seed=0)
    ids = pool.allocate(2)
    pool.cache(ids[0], h[0], range(4))
    pool.cache(ids[1], h[1], range(4, 8))
    pool.free(list(reversed(ids)))  # tail block first: evicted first
    assert pool.lookup(h[0], range(4)) == ids[0]
    assert pool.lookup(h[0], [9, 9, 9, 9]) is None  # token check guards collisions
    pool.allocate(1)  # the never-used block 2 goes first
    pool.allocate(1)  # then the LRU cached one: the tail block ids[1]
    assert pool.lookup(h[1], range(4, 8)) is None
    assert pool.lookup(h[0], range(4)) == ids[0]
    kinds = [e.kind for e in pool.drain_events()]
    assert kinds == [KVEventKind.STORED, KVEventKind.STORED, KVEventKind.REMOVED]


def test_hashes_chain_and_agree_across_processes() -> None:
    toks = list(range(40))
    a = hash_token_blocks(toks, 16, seed=5)
    assert len(a) == 2  # full blocks only
    assert hash_token_blocks(toks[:16] + [99] * 16, 16, seed=5)[0] == a[0]
    assert hash_token_blocks([99] * 16 + toks[16:32], 16, seed=5)[1] != a[1]  # chained
    assert hash_token_blocks(toks, 16, seed=6)[0] != a[0]  # seeded
    assert hash_token_blocks(toks, 16, seed=5, prior=a[:1]) == a  # extends lazily
    code = ("from core.kv import hash_token_blocks;"
            "print(hash_token_blocks(list(range(40)), 16, seed=5)[1].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == a[1].hex()
    assert root_hash(5) != root_hash(6)


def _req(rid: str, toks: list[int]) -> Request:
    return Request(rid, toks, SamplingParams(max_tokens=4))


def test_manager_prefix_hit_and_free() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = _req("a", list(range(10)))
    assert kv.allocate(r1, 10)
    r1.num_computed_tokens = 10
    kv.cache_computed(r1)  # 2 full blocks registered
    r2 = _req("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_cached_prefix(r2)
    assert hit == kv.table("a")[:2]
    r2.num_computed_tokens = 8
    assert kv.allocate(r2, 3, hit)
    assert kv.pool.blocks[hit[0]].ref_cnt == 2
    # a prompt that is exactly cached still computes its last token
    r3 = _req("c", list(range(8)))
    assert len(kv.find_cached_prefix(r3)) == 1
    kv.free(r1)
    kv.free(r2)
    kv.free(r2)  # idempotent
    kv.leak_check()


def test_manager_refuses_when_full_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = _req("a", list(range(12)))
    assert not kv.allocate(r, 12)
    assert kv.pool.num_free == 2
    kv.free(r)
    kv.leak_check()
