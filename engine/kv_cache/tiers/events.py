"""Which tier holds which block, as events: the device pool's (BlockPool.events) with the
medium and tokens added, and the lower tiers' own. Published to other routers in
vLLM's format by worker/kv_events_zmq.py. The medium names follow vLLM's: its device
pool is "GPU" (whatever device the engine runs on), its host tier "CPU"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from core.kv.block_hash import BlockHash
from engine.kv_cache.block_pool import BlockPool, KVEvent, KVEventKind

MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "DISK"


@dataclass(frozen=True)
class TierEvent:
    kind: KVEventKind
    block_hash: BlockHash
    medium: str
    tokens: tuple[int, ...] = ()
    """A stored block's tokens (empty for a removal, and for a device block stored and
    evicted again before the events were read: its removal follows)."""


def device_events(pool: BlockPool, events: Iterable[KVEvent]) -> list[TierEvent]:
    """The pool's drained events with their medium and, for a stored block still
    cached, its tokens (engine thread: reads the pool)."""
    out = []
    for e in events:
        tokens: tuple[int, ...] = ()
        if e.kind is KVEventKind.STORED and (bid := pool.cached.get(e.block_hash)) is not None:
            tokens = pool.blocks[bid].token_ids or ()
        out.append(TierEvent(e.kind, e.block_hash, MEDIUM_DEVICE, tokens))
    return out


def device_blocks(pool: BlockPool) -> list[TierEvent]:
    """Every block the device pool caches now, as stores (a publisher's first batch)."""
    return [TierEvent(KVEventKind.STORED, h, MEDIUM_DEVICE, pool.blocks[bid].token_ids or ())
            for h, bid in pool.cached.items()]
