"""The host tier: an LRU of whole KV blocks in host memory, by block hash.

Bookkeeping only: which slot of the host KV tensor (shared with the swap pool,
engine/kv_cache/swap.py) holds which block; the bytes are moved by the TieredCache.
A block is one block of the whole model (every layer, K and V, int8 rows with their
scales), keyed by its chained hash, which already carries the tenant's cache salt
(core/kv/block_hash.py); its tokens are kept and compared on a hit, as the device
pool does. Not thread-safe: the engine thread owns it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from core.kv.block_hash import BlockHash
from engine.kv_cache.swap import HostSlots


@dataclass
class HostEntry:
    slot: int
    tokens: tuple[int, ...]
    pins: int = 0
    """Promotions reading this slot in the current step, or a disk read filling it:
    never evicted while pinned."""
    loading: bool = False
    """A disk read is filling the slot (loader.py): not a hit until it lands."""
    from_disk: bool = False
    """Read up from the disk tier and not promoted since (a promotion counts as a disk hit)."""


class HostTier:
    def __init__(self, slots: HostSlots,
                 on_evict: Callable[[BlockHash, HostEntry], None]) -> None:
        """The tier fills any free slot: its own (--kv-offload-cpu-gib) and those the
        swap pool is not using, which the swap pool reclaims (HostSlots.reclaim).
        on_evict(hash, entry) is called before an entry's slot is reused or returned
        (the place to copy it to disk)."""
        self.slots = slots
        self.entries: OrderedDict[BlockHash, HostEntry] = OrderedDict()
        self._on_evict = on_evict
        slots.reclaim = self.evict_lru
        slots.reclaimable = lambda: sum(1 for e in self.entries.values() if not e.pins)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: BlockHash, tokens: Sequence[int]) -> HostEntry | None:
        """The entry holding this hash and these tokens (made most recently used)."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.loading or entry.tokens != tuple(tokens):
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def reserve(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | None:
        """A slot for a block not held yet (the caller fills it now): a free slot, else
        the least recently used block's; None when every slot is pinned or the swap
        pool's."""
        ids = self.slots.take(1)
        if ids is None and self.entries:
            self.evict_lru(1)
            ids = self.slots.take(1)
        if ids is None:
            return None
        self.entries[block_hash] = HostEntry(ids[0], tuple(tokens))
        return ids[0]

    def evict_lru(self, n: int) -> int:
        """Give up to n least recently used unpinned blocks' slots back; how many went."""
        gone = 0
        for block_hash in list(self.entries):
            if gone == n:
                break
            entry = self.entries[block_hash]
            if entry.pins:
                continue
            self._on_evict(block_hash, entry)
            del self.entries[block_hash]
            self.slots.give([entry.slot])
            gone += 1
        return gone
