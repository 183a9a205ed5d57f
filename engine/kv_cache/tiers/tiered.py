"""The tiers below the device pool, as the KV manager sees them: blocks the pool evicts
come down (``demote``), a prefix that misses on the device comes back up (``promote``).

Every copy goes through the runner's ``copy_blocks`` (at --tensor-parallel-size > 1
each rank copies its own heads), and whole blocks go to and from disk through its
``read_host_blocks``/``write_host_blocks`` (a block file holds every head: at TP > 1
they are gathered from and scattered to the ranks' host slots, on the engine thread).
Demotion copies the evicted block into a host slot at once, on the engine thread: an
evicted block is about to be reused, and nothing writes a block between its eviction
and the step's forward pass, so its bytes are still the cached ones. A host block that
loses its slot is queued for the disk tier (a copy of its bytes; the writer thread
writes it).

Promotion is bookkeeping at admission, copies before the forward: ``promote`` takes
device blocks for the lower-tier hits (evicting as any allocation does), registers them
under their hashes, holds one reference on each and pins their host sources; ``flush``
(after the step's swap copies, engine.apply_preemptions) copies the bytes in, then
drops the holds and pins. So a promoted block is never evicted, and a host slot being
read never reused, before its copy ran; and a device block freed by a swap-out in the
same step is read (swap-out) before a promotion writes it.

A disk hit is not read on the step loop: ``fetch`` (the scheduler asks before it admits
a request) reserves host slots for the prompt's blocks that are on disk only and has a
reader thread fill them (loader.py); while any is being read the request waits in the
scheduler, and the engine steps the others. A read that lands makes a host block (a
corrupt or foreign file is a miss, recomputed); the request's next admission promotes
it from the host as above (docs/kv-offload.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from core.kv.block_hash import BlockHash
from engine.kv_cache.block_pool import BlockPool, KVEventKind
from engine.kv_cache.swap import HostSlots
from engine.kv_cache.tiers.disk import DiskTier
from engine.kv_cache.tiers.events import MEDIUM_DISK, MEDIUM_HOST, TierEvent
from engine.kv_cache.tiers.host import HostEntry, HostTier
from engine.kv_cache.tiers.loader import DiskLoader


@dataclass
class TierStats:
    demoted: int = 0
    """Device blocks copied into the host tier."""
    not_demoted: int = 0
    """Evicted device blocks no host slot could take (every one pinned or the swap
    pool's): lost, as without tiers."""
    host_hits: int = 0
    """Blocks promoted from the host tier."""
    disk_hits: int = 0
    """Blocks promoted from the disk tier."""


Pairs = list[tuple[list[int], list[int]]]
CopyBlocks = Callable[[Pairs, Pairs], object]
"""ModelRunner.copy_blocks(swap_out [(device ids, host slots)], swap_in [(host slots,
device ids)]): at --tensor-parallel-size > 1 every rank copies its heads' bytes."""


class HostBlocks(Protocol):
    """Whole blocks of host slots as a block file holds them (every KV head)."""

    def read_host_blocks(self, slots: list[int]) -> torch.Tensor:
        """``[n, block bytes]`` uint8 on the CPU."""

    def write_host_blocks(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Host slots := ``blocks`` (``[n, block bytes]`` uint8, every head)."""


class TieredCache:
    def __init__(self, slots: HostSlots, block_size: int, copy_blocks: CopyBlocks,
                 disk: DiskTier | None = None, host_blocks: HostBlocks | None = None) -> None:
        """copy_blocks: how bytes move between the device pool and host slots (the
        runner's: at TP > 1 every rank copies its heads); host_blocks: how the disk tier
        reads and fills whole host blocks (the runner; needed with ``disk``)."""
        self.copy_blocks = copy_blocks
        self.slots = slots
        self.block_size = block_size
        self.disk = disk
        self.host_blocks = host_blocks
        self.loader = DiskLoader(disk) if disk is not None else None
        self._unreadable: set[BlockHash] = set()
        """Blocks listed on disk whose read failed without the file being dropped (other
        tokens under the hash): misses, never read again."""
        self.host = HostTier(slots, self._spill)
        self.stats = TierStats()
        self.pool: BlockPool | None = None
        self._copies: list[tuple[int, HostEntry]] = []
        """Promotions to copy at flush: (device block, its source)."""
        self._held: list[int] = []
        self.events: list[TierEvent] = []
        """The host tier's stores and removals since drain_events (the engine thread
        drains them every step, as the device pool's)."""
        self.origin: dict[int, tuple[str, BlockHash]] = {}
        """Device blocks promoted and not yet adopted by a request: the tier they came
        from (claim), with the hash they were promoted under."""

    def attach(self, pool: BlockPool) -> None:
        """Hook into the device pool: its evictions come down here (the KV manager's
        prefix misses look here: KVCacheManager.lower_tiers)."""
        self.pool = pool
        pool.on_evict = self.demote

    # -- down ---------------------------------------------------------------------------
    def demote(self, block_id: int, block_hash: BlockHash, tokens: Sequence[int]) -> None:
        """The pool is evicting a cached block: keep a copy in the host tier."""
        self.origin.pop(block_id, None)
        if block_hash in self.host.entries:  # promoted from here earlier (the same bytes),
            self.host.entries.move_to_end(block_hash)  # or being read up from disk
            return
        slot = self.host.reserve(block_hash, tokens)
        if slot is None:
            self.stats.not_demoted += 1
            return
        self.copy_blocks([([block_id], [slot])], [])
        self.stats.demoted += 1
        self.events.append(TierEvent(KVEventKind.STORED, block_hash, MEDIUM_HOST, tuple(tokens)))

    def _spill(self, block_hash: BlockHash, entry: HostEntry) -> None:
        """A host block loses its slot: the disk tier gets a copy (if there is one)."""
        self.events.append(TierEvent(KVEventKind.REMOVED, block_hash, MEDIUM_HOST))
        if self.disk is not None:
            payload = self.host_blocks.read_host_blocks([entry.slot])[0].numpy().tobytes()
            self.disk.put(block_hash, entry.tokens, payload)

    # -- up -----------------------------------------------------------------------------
    def promote(self, hit: list[int], hashes: Sequence[BlockHash],
                token_ids: Sequence[int]) -> list[int]:
        """Device blocks holding the host tier's hits that continue ``hit`` (the device's
        own prefix hit, its blocks' ids) along ``hashes``; no references taken for the
        caller (as BlockPool.lookup). Bounded by the free device blocks."""
        self._land()
        pool, bs = self.pool, self.block_size
        found: list[tuple[BlockHash, tuple[int, ...], HostEntry]] = []
        for i in range(len(hit), min(len(hashes), len(hit) + self._room(hit))):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            source = self.host.get(hashes[i], tokens)
            if source is None:
                break
            source.pins += 1  # from here on its slot is neither reused nor reclaimed
            found.append((hashes[i], tokens, source))
        if not found:
            return []
        pool.touch(hit)  # the allocation below must not evict the device hit
        ids = pool.allocate(len(found))
        pool.free(list(reversed(hit)))
        for bid, (block_hash, tokens, source) in zip(ids, found):
            pool.cache(bid, block_hash, tokens)
            self._copies.append((bid, source))
            self.origin[bid] = (MEDIUM_DISK if source.from_disk else MEDIUM_HOST, block_hash)
            if source.from_disk:
                self.stats.disk_hits += 1
            else:
                self.stats.host_hits += 1
            source.from_disk = False  # promoted again later: from the host
        self._held += ids
        return ids

    def _room(self, hit: list[int]) -> int:
        """Device blocks a promotion continuing ``hit`` may take (the free ones that are
        not the hit's own)."""
        return self.pool.num_free - sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)

    def fetch(self, hit: list[int], hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> bool:
        """The prompt's cached prefix is ``hit`` (device blocks, promoted ones included):
        start reading its next blocks that are on disk only into host slots, as many as
        the device has room to promote them into. True while any of them is being
        read: the request waits (and is promoted from the host as reads land)."""
        if self.loader is None:
            return False
        bs, waiting = self.block_size, False
        for i in range(len(hit), min(len(hashes), len(hit) + self._room(hit))):
            h, tokens = hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])
            if h in self.loader.pending:
                waiting = True
                continue
            if self.host.get(h, tokens) is not None:
                continue
            if h in self._unreadable or h in self.host.entries or h not in self.disk:
                break
            if self.host.reserve(h, tokens) is None:
                # every slot pinned: by this step's promotions (free after its flush, so
                # wait a step for the rest of the prefix), or by the swap pool (go on)
                return waiting or bool(self._copies)
            entry = self.host.entries[h]
            entry.loading, entry.pins = True, entry.pins + 1
            self.loader.start(h, tokens)
            waiting = True
        return waiting

    def _land(self) -> None:
        """Collect the disk reads that ended: host blocks now (their bytes written into
        their slots here, on the engine thread), or their slots back."""
        for h, block in self.loader.landed() if self.loader is not None else ():
            entry = self.host.entries[h]
            entry.pins, entry.loading = entry.pins - 1, False
            if block is not None:
                self.host_blocks.write_host_blocks([entry.slot], block.view(1, -1))
                entry.from_disk = True
                self.events.append(TierEvent(KVEventKind.STORED, h, MEDIUM_HOST, entry.tokens))
                continue
            del self.host.entries[h]
            self.slots.give([entry.slot])
            if h in self.disk:
                self._unreadable.add(h)

    def wait_for_loads(self, timeout: float) -> None:
        """Until a disk read lands, at most ``timeout`` s (nothing else to run)."""
        if self.loader is not None:
            self.loader.wait(timeout)

    def flush(self) -> None:
        """Run the promotions' copies, then release their holds and pins (after the step's
        swap copies, before its forward)."""
        if self._copies:  # the copies are done when this returns: the sources are reusable
            self.copy_blocks([], [([s.slot for _, s in self._copies],
                                   [bid for bid, _ in self._copies])])
        for _, source in self._copies:
            source.pins -= 1
        self._copies.clear()
        if self._held:
            self.pool.free(list(reversed(self._held)))
            self._held.clear()

    def close(self) -> None:
        """The disk reader and writer finish their queues and stop (engine shutdown)."""
        if self.loader is not None:
            self.loader.close()
        if self.disk is not None:
            self.disk.close()

    def claim(self, block_ids: Sequence[int]) -> tuple[int, int]:
        """A request adopts these prefix blocks: (how many of them were promoted for it
        from the host tier, from the disk tier); from now on they are device hits."""
        counts = {MEDIUM_HOST: 0, MEDIUM_DISK: 0}
        for bid in block_ids:
            medium, block_hash = self.origin.pop(bid, (None, None))
            if medium is not None and self.pool.blocks[bid].block_hash == block_hash:
                counts[medium] += 1
        return counts[MEDIUM_HOST], counts[MEDIUM_DISK]

    def stored(self) -> list[TierEvent]:
        """What the tiers hold now, as stores (the disk's blocks found at start-up, and
        the host's): a subscriber's snapshot, with drain_events after it."""
        now = [TierEvent(KVEventKind.STORED, h, MEDIUM_HOST, e.tokens)
               for h, e in self.host.entries.items()]
        return now + (self.disk.stored() if self.disk is not None else [])

    def drain_events(self) -> list[TierEvent]:
        """The host and disk tiers' events since the last call (engine thread)."""
        events, self.events = self.events, []
        return events + (self.disk.drain_events() if self.disk is not None else [])

    # -- checks -------------------------------------------------------------------------
    def host_blocks_in_use(self) -> int:
        return len(self.host)

    def leak_check(self, swap_used: int) -> None:
        """AssertionError unless no promotion is pending and every host slot is free,
        the swap pool's, or holds one host-tier block."""
        if self.loader is not None:  # reads still running land first
            while self.loader.pending:
                self.loader.wait(1.0)
                self._land()
        if self._copies or self._held:
            raise AssertionError(f"tier leak: {len(self._held)} promoted blocks still held")
        pinned = [h for h, e in self.host.entries.items() if e.pins]
        accounted = self.slots.num_free + self.slots.num_settling + len(self.host) + swap_used
        if pinned or accounted != self.slots.num_slots:
            raise AssertionError(f"host slot leak: {accounted}/{self.slots.num_slots} accounted, "
                                 f"{len(pinned)} pinned")
