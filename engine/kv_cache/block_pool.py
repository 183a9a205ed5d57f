"""The block pool: ref counts, an LRU free queue, and the prefix-cache index.

A block is *free* when no request references it (ref_cnt == 0). A free block may
still hold a cached full block (it keeps its hash and tokens) and can be reused
by a later hit until it is evicted, which happens when allocation pops it off
the front of the LRU free queue. Not thread-safe: one engine thread owns it.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from core.kv.block_hash import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    """Published to the router's prefix index: a block hash became (un)available."""

    kind: KVEventKind
    block_hash: BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.events: list[KVEvent] = []
        self.on_evict: Callable[[int, BlockHash, tuple[int, ...]], None] | None = None
        """Told (block id, hash, tokens) before a cached block is evicted for reuse, its
        bytes still intact: the lower KV tiers keep a copy (engine/kv_cache/tiers)."""

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks from the LRU end (evicting cached ones); None if too few."""
        if n > len(self.free_queue):
            return None
        ids = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            block = self.blocks[bid]
            if self.on_evict is not None and block.block_hash is not None \
                    and self.cached.get(block.block_hash) == bid:
                self.on_evict(bid, block.block_hash, block.token_ids)
            self._evict(block)
            self.blocks[bid].ref_cnt = 1
            ids.append(bid)
        return ids

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | None:
        """A cached block with this hash *and* these tokens (guards hash collisions)."""
        bid = self.cached.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tuple(tokens):
            return None
        return bid

    def touch(self, ids: Sequence[int]) -> None:
        """Take a reference on blocks found by lookup (removes them from the free queue)."""
        for bid in ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self.free_queue[bid]
            block.ref_cnt += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the
        given order (callers pass a request's blocks tail-first, so its last blocks
        are evicted before its shared prefix)."""
        for bid in ids:
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[bid] = None

    def cache(self, bid: int, block_hash: BlockHash, tokens: Sequence[int]) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        block = self.blocks[bid]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(tokens)
        self.cached[block_hash] = bid
        self.events.append(KVEvent(KVEventKind.STORED, block_hash))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
            self.events.append(KVEvent(KVEventKind.REMOVED, block.block_hash))
        block.block_hash, block.token_ids = None, None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def leak_check(self) -> None:
        """Raise AssertionError unless every block is free and no ref count is held."""
        held = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if held or len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"KV leak: {len(held)} blocks still referenced "
                                 f"(e.g. {held[:8]}), {len(self.free_queue)}/{self.num_blocks} free")
