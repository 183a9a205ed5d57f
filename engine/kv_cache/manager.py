"""Per-request block tables over the block pool, with automatic prefix caching.

Invariants: a running request's table covers at least ``num_computed_tokens``
tokens plus what is scheduled this step; every block in a table holds one
reference; a request's full, computed blocks are registered in the prefix
cache as soon as they are computed.

Sliding windows (``sliding_window``: set when every layer of the model slides, to the
largest window): a block no layer can attend to any more, wholly before the window of
the request's next query, is freed (``allocate`` drops it before growing the table)
and its table entry becomes ``NULL_BLOCK``. Those entries are always a prefix of the
table, never read by an attention backend (they start at the window), and a request
then holds at most window / block_size + 2 blocks while it decodes; admission counts
only the blocks a request really holds and will get. A freed block was registered
in the prefix cache when it was computed (it is freed only once the window has passed
it), so it stays a valid cache entry until evicted; a prefix hit is still the whole
chain of cached blocks from the first one (every block present), so a hit is exact.

Forks (n > 1, engine/fork.py): a forked choice's table starts as its parent's blocks,
one more reference each. A block is written only at a sequence's next position, so
the one block that may be shared and written is the one holding position
``num_computed_tokens``: ``allocate`` copies it first (copy-on-write) when its ref count
says another sequence holds it, and queues the (source, copy) pair; the engine copies
the bytes before the step's forward (``take_copies``). The last holder writes in place.

Bounded KV policies (``req.kv_policy``, engine/kv_cache/policy.py): a request keeps its
leading sink blocks and its newest blocks; the dropped ones are a hole between them
(``NULL_BLOCK`` entries from ``head`` to the hole's end). Attention reads the held blocks
as one compact cache with positions within it, so dropping blocks moves every later
block down: ``on_shift`` re-rotates their keys (the runner's ``shift_keys``) as they are
dropped, before any later read or copy. A bounded request's blocks never enter the prefix
cache and it adopts none (re-rotated keys are not the prompt's keys at its positions).
Under h2o the table is the request's compacted slots (``kept_tokens`` of them computed):
it never has a hole and never grows past the budget's blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from core.kv.block_hash import BlockHash, hash_token_blocks
from engine.kv_cache.block_pool import BlockPool
from core.kv.layout import blocks_for
from engine.kv_cache.policy import chunk_limit, kept_tokens, live_bounds

if TYPE_CHECKING:
    from engine.kv_cache.tiers.tiered import TieredCache
    from engine.request import Request


NULL_BLOCK = -1
"""A table entry whose block was freed: wholly before the sliding window (never read)."""
_CHAIN_BROKEN = 1 << 62
"""_num_cached of a request whose chain has a hole: no later block is registered."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: int = 0, sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.sliding_window = sliding_window
        """Every layer's keys lie within this many positions of its query (None: some
        layer sees the whole context): blocks before that window are freed."""
        self._dropped: dict[str, int] = {}  # end of the table's hole of freed entries
        self.on_shift: Callable[[list[int], int], None] | None = None
        """Told (blocks, delta) when a bounded request's dropped blocks move these held
        blocks delta (< 0) positions down in its cache: their keys are re-rotated."""
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already registered per request
        self.lower_tiers: TieredCache | None = None
        """Where evicted blocks went (engine/kv_cache/tiers): a device miss looks there."""
        self.copies: list[tuple[int, int]] = []
        """(source, copy) blocks that copy-on-write queued; copied before the next forward."""

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
        if not self.enable_prefix_caching or req.kv_policy is not None:
            return []
        limit = (len(req.token_ids) - 1) if max_tokens is None else max_tokens
        hashes = self.block_hashes(req)[: limit // self.block_size]
        hit = self._device_prefix(req, hashes)
        if self.lower_tiers is not None and len(hit) < len(hashes):
            hit += self.lower_tiers.promote(hit, hashes, req.token_ids)
        return hit

    def _device_prefix(self, req: Request, hashes: list[BlockHash]) -> list[int]:
        hit: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            bid = self.pool.lookup(h, req.token_ids[i * bs:(i + 1) * bs])
            if bid is None:
                break
            hit.append(bid)
        return hit

    def prefix_loading(self, req: Request) -> bool:
        """Whether a lower tier is still reading part of req's cached prefix up from
        disk (started now where needed): the request waits in the scheduler until its
        blocks are in host memory, and the step goes on without it."""
        if self.lower_tiers is None or not self.enable_prefix_caching:
            return False
        hashes = self.block_hashes(req)[: (len(req.token_ids) - 1) // self.block_size]
        hit = self._device_prefix(req, hashes)
        if len(hit) < len(hashes):  # what is on the host comes up now, the disk's after
            hit += self.lower_tiers.promote(hit, hashes, req.token_ids)
        return len(hit) < len(hashes) and self.lower_tiers.fetch(hit, hashes, req.token_ids)

    def claim_promoted(self, cached: list[int]) -> tuple[int, int]:
        """A request adopted these prefix blocks: (tokens of them promoted for it from
        the host tier, from the disk tier); later hits on them are device hits."""
        if self.lower_tiers is None or not cached:
            return 0, 0
        host, disk = self.lower_tiers.claim(cached)
        return host * self.block_size, disk * self.block_size

    def first_live_block(self, num_computed: int) -> int:
        """The first block the query at position ``num_computed`` (the next one computed)
        or any later one can see: 0 without a sliding window."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _bounds(self, req: Request, num_new_tokens: int, slide: bool) -> tuple[int, int]:
        """(head, first): the table entries [0, head) and [first, ...) are held for the
        next num_new_tokens queries (at least one), those between them dropped."""
        if req.kv_policy is not None:
            return live_bounds(req.kv_policy, self.block_size, req.num_computed_tokens,
                               num_new_tokens)
        return 0, self.first_live_block(req.num_computed_tokens) if slide else 0

    def _target(self, req: Request, num_new_tokens: int) -> int:
        """Blocks req's table covers once num_new_tokens more are computed."""
        return self.blocks_needed(kept_tokens(req.kv_policy, req.num_computed_tokens)
                                  + num_new_tokens)

    def chunk_limit(self, req: Request, num_new_tokens: int) -> int:
        """The most of num_new_tokens one step may compute for req (a bounded policy
        stops a chunk where its kept blocks would change: engine/kv_cache/policy.py)."""
        if req.kv_policy is None:
            return num_new_tokens
        return chunk_limit(req.kv_policy, self.block_size, req.num_computed_tokens,
                           num_new_tokens)

    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[int] = (),
                     slide: bool = True) -> bool:
        """Whether ``allocate`` would succeed (the blocks it would drop first are counted
        free only by allocate itself, which drops them either way)."""
        table = self.tables.get(req.request_id, [])
        head, first = self._bounds(req, num_new_tokens, slide)
        start = max(len(table), len(cached))
        target = self._target(req, num_new_tokens)
        need = max(0, min(head, target) - start) + max(0, target - max(first, start))
        evictable_hits = sum(1 for b in cached[first:] if self.pool.blocks[b].ref_cnt == 0)
        if num_new_tokens and self._shared_write(req) is not None:
            need += 1  # its copy
        return need <= self.pool.num_free - evictable_hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = (),
                 slide: bool = True) -> bool:
        """Grow req's table to cover num_computed_tokens + num_new_tokens, first adopting
        ``cached`` prefix blocks (only for a request with no table yet). With a sliding
        window (and ``slide``: False keeps every block, for a table someone else reads
        whole) or a bounded policy, the blocks the next queries cannot see are dropped
        first and none of them is taken or adopted. False when the pool is too small (the
        dead blocks are dropped either way: no query reads them again)."""
        head, first = self._bounds(req, num_new_tokens, slide)
        self._drop(req.request_id, head, first, req.kv_policy is not None)
        if not self.can_allocate(req, num_new_tokens, cached, slide):
            return False
        table = self.tables.setdefault(req.request_id, [])
        if cached:
            assert not table, "cached prefix blocks are adopted only at admission"
            self.pool.touch(cached[first:])
            table.extend([NULL_BLOCK] * min(first, len(cached)) + list(cached[first:]))
            self._num_cached[req.request_id] = len(cached)
        target = self._target(req, num_new_tokens)
        # a table rebuilt mid-context (swap-in, a load from elsewhere) has its hole too
        held = [i < head or i >= first for i in range(len(table), max(target, first))]
        fresh = iter(self.pool.allocate(sum(held)) or ())
        table.extend(next(fresh) if h else NULL_BLOCK for h in held)
        if first > head:
            self._dropped[req.request_id] = max(self._dropped.get(req.request_id, head),
                                                min(first, len(table)))
        if num_new_tokens:
            self._copy_on_write(req)
        return True

    def _shared_write(self, req: Request) -> int | None:
        """The index in req's table of the block its next token is written into, when
        another sequence (a fork) holds it too; None when req may write in place."""
        table = self.tables.get(req.request_id)
        i = req.num_computed_tokens // self.block_size
        if table is None or i >= len(table) or table[i] == NULL_BLOCK:
            return None
        return i if self.pool.blocks[table[i]].ref_cnt > 1 else None

    def _copy_on_write(self, req: Request) -> None:
        i = self._shared_write(req)
        if i is None:
            return
        table = self.tables[req.request_id]
        src, (dst,) = table[i], self.pool.allocate(1)
        self.pool.free([src])
        table[i] = dst
        self.copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs queued since the last call (the engine copies them
        before the forward: the source keeps its bytes until then, as another sequence
        still holds it)."""
        copies, self.copies = self.copies, []
        return copies

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """child (a new choice of parent) shares parent's blocks covering its first
        num_tokens tokens, a reference each; what parent registered in the prefix cache
        counts as registered for child too (their leading tokens are the same)."""
        pid, cid = parent.request_id, child.request_id
        table = self.tables[pid][: self.blocks_needed(num_tokens)]
        self.pool.touch([b for b in table if b != NULL_BLOCK])
        self.tables[cid] = list(table)
        if self._dropped.get(pid):
            self._dropped[cid] = min(self._dropped[pid], len(table))
        done = self._num_cached.get(pid, 0)
        self._num_cached[cid] = done if done == _CHAIN_BROKEN else min(
            done, num_tokens // self.block_size)
        child.block_hashes = list(parent.block_hashes[: num_tokens // self.block_size])


    def _drop(self, request_id: str, head: int, first: int, shift: bool) -> None:
        """Free the table's blocks from ``head`` up to index ``first`` (no query will see
        them again), oldest first, leaving NULL_BLOCK in their place. ``shift`` (a bounded
        policy: positions within the cache): the held blocks after them move down
        (``on_shift``)."""
        table = self.tables.get(request_id)
        done = max(self._dropped.get(request_id, head), head)
        if table is None or first <= done:
            return
        end = min(first, len(table))
        gone = [b for b in table[done:end] if b != NULL_BLOCK]
        self.pool.free(gone)
        table[done:end] = [NULL_BLOCK] * (end - done)
        self._dropped[request_id] = end
        moved = [b for b in table[end:] if b != NULL_BLOCK]
        if shift and gone and moved and self.on_shift is not None:
            self.on_shift(moved, -len(gone) * self.block_size)

    def live_blocks(self, req: Request, slide: bool = True) -> list[int]:
        """The blocks covering req's computed tokens that a later query can read, in table
        order (the dead ones are dropped first), e.g. to swap out; after
        ``allocate(req, 0, slide=slide)`` rebuilds the table they are as many again."""
        head, first = self._bounds(req, 0, slide)
        self._drop(req.request_id, head, first, req.kv_policy is not None)
        table = self.tables[req.request_id][: self._target(req, 0)]
        return [b for b in table if b != NULL_BLOCK]

    def first_held(self, request_id: str) -> int:
        """The end of the table's hole of dropped entries (0 when none was dropped)."""
        return self._dropped.get(request_id, 0)

    def cache_computed(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache, up to a
        dropped block that was never registered (its KV was loaded elsewhere, or a swap-in
        rebuilt the table without it): a chain with a hole could never be hit, so none
        of the request's later hashes is published."""
        if not self.enable_prefix_caching or req.kv_policy is not None:
            return
        table = self.tables[req.request_id]
        done = self._num_cached.get(req.request_id, 0)
        full = req.num_computed_tokens // self.block_size
        if full <= done:
            return
        hashes = self.block_hashes(req)
        bs = self.block_size
        for i in range(done, full):
            if table[i] == NULL_BLOCK:
                self._num_cached[req.request_id] = _CHAIN_BROKEN
                return
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
        self._dropped.pop(req.request_id, None)
        if table:
            self.release(table)

    def detach(self, request_id: str) -> list[int]:
        """Take a request's table out of the manager, its block references with it: the
        taker frees it with ``release`` (the request's own ``free`` then frees none)."""
        self._num_cached.pop(request_id, None)
        self._dropped.pop(request_id, None)
        return self.tables.pop(request_id)

    def release(self, table: list[int]) -> None:
        """Free a table's blocks tail-first (its last blocks are then evicted before
        its shared prefix, BlockPool.free); dropped entries hold nothing."""
        self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    @property
    def usage(self) -> float:
        return self.pool.usage

    def leak_check(self) -> None:
        if self.tables:
            raise AssertionError(f"KV leak: tables still held by {sorted(self.tables)[:8]}")
        self.pool.leak_check()
