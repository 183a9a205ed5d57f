"""Per-request block tables over the block pool, with automatic prefix caching.

Invariants: a running request's table covers at least ``num_computed_tokens``
tokens plus what is scheduled this step; every block in a table holds one
reference; a request's full, computed blocks are registered in the prefix
cache as soon as they are computed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.kv.block_hash import BlockHash, hash_token_blocks
from engine.kv_cache.block_pool import BlockPool
from core.kv.layout import blocks_for

if TYPE_CHECKING:
    from engine.kv_cache.tiers.tiered import TieredCache
    from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already registered per request
        self.lower_tiers: TieredCache | None = None
        """Where evicted blocks went (engine/kv_cache/tiers): a device miss looks there."""

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """The request's chained hashes over all its full blocks (extended lazily), under
        its cache salt: a prefix is found only among blocks cached under the same salt."""
        if len(req.block_hashes) < len(req.token_ids) // self.block_size:
            req.block_hashes = hash_token_blocks(req.token_ids, self.block_size, self.hash_seed,
                                                 prior=req.block_hashes, salt=req.cache_salt)
        return req.block_hashes

    def find_cached_prefix(self, req: Request, max_tokens: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of req.token_ids (no refs taken).

        At most ``max_tokens`` tokens (default: all but the last, so one token is always
        computed to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        limit = (len(req.token_ids) - 1) if max_tokens is None else max_tokens
        hit: list[int] = []
        hashes = self.block_hashes(req)[: limit // self.block_size]
        for i, h in enumerate(hashes):
            bs = self.block_size
            bid = self.pool.lookup(h, req.token_ids[i * bs:(i + 1) * bs])
            if bid is None:
                break
            hit.append(bid)
        if self.lower_tiers is not None and len(hit) < len(hashes):
            hit += self.lower_tiers.promote(hit, hashes, req.token_ids)
        return hit

    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        table = self.tables.get(req.request_id, [])
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table) - len(cached)
        evictable_hits = sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        return need <= self.pool.num_free - evictable_hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Grow req's table to cover num_computed_tokens + num_new_tokens, first adopting
        ``cached`` prefix blocks (only for a request with no table yet). False (and no
        change) when the pool is too small."""
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        table = self.tables.setdefault(req.request_id, [])
        if cached:
            assert not table, "cached prefix blocks are adopted only at admission"
            self.pool.touch(cached)
            table.extend(cached)
            self._num_cached[req.request_id] = len(cached)
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[req.request_id]
        done = self._num_cached.get(req.request_id, 0)
        full = req.num_computed_tokens // self.block_size
        if full <= done:
            return
        hashes = self.block_hashes(req)
        bs = self.block_size
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i], req.token_ids[i * bs:(i + 1) * bs])
        self._num_cached[req.request_id] = full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the table's blocks beyond the first num_tokens tokens (slots of rejected
        speculative tokens: never computed, so never in the prefix cache)."""
        table = self.tables.get(req.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is not None and len(table) > keep:
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def free(self, req: Request) -> None:
        """Release every block of req exactly once (idempotent per request)."""
        table = self.tables.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if table:
            self.release(table)

    def detach(self, request_id: str) -> list[int]:
        """Take a request's table out of the manager, its block references with it: the
        taker frees it with ``release`` (the request's own ``free`` then frees none)."""
        return self.tables.pop(request_id)

    def release(self, table: list[int]) -> None:
        """Free a table's blocks tail-first (its last blocks are then evicted before
        its shared prefix, BlockPool.free)."""
        self.pool.free(list(reversed(table)))

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    @property
    def usage(self) -> float:
        return self.pool.usage

    def leak_check(self) -> None:
        if self.tables:
            raise AssertionError(f"KV leak: tables still held by {sorted(self.tables)[:8]}")
        self.pool.leak_check()
