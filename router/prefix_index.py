"""Which worker holds which KV blocks, and in which tier (device, host memory, disk:
docs/kv-offload.md), from the workers' KV event streams, plus the blocks of requests
just routed to a worker and not yet reported by it.

Without the second part, requests that share a prefix and arrive together all look
like misses (the first one's blocks are not computed yet) and spread over the pool;
with it, they follow the first one, as SGLang's cache-aware router does by inserting
at routing time. An expectation ends when the worker reports the block (stored or
removed) or after EXPECT_TTL_S."""
from __future__ import annotations

import enum
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

from core.kv import BlockHash

EXPECT_TTL_S = 60.0


class Tier(enum.IntEnum):
    """Where a worker holds a block, best first (the values of common.KVEvent.Medium)."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class Overlap:
    """A prompt's leading blocks on one worker."""

    by_tier: tuple[int, int, int] = (0, 0, 0)
    """Leading blocks the worker reported holding, by the best tier holding each
    (indexed by Tier), up to the first block it neither holds nor is expected to."""
    expected: int = 0
    """Blocks of that walk it only is about to hold (routed there within EXPECT_TTL_S:
    they will be computed on its device)."""
    reported: int = 0
    """Leading blocks reported held, up to the first expected-only one (any tier)."""

    @property
    def blocks(self) -> int:
        """Leading blocks held or about to be, in any tier."""
        return sum(self.by_tier) + self.expected

    @property
    def on_device(self) -> int:
        """Blocks of the walk that need no device block of their own: held on the
        device or about to be (a lower tier's hit is promoted into fresh ones)."""
        return self.by_tier[Tier.DEVICE] + self.expected


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[BlockHash, dict[str, int]] = defaultdict(dict)
        """block hash -> worker -> the tiers holding it there (bit 1 << Tier)."""
        self._by_worker: dict[str, set[BlockHash]] = defaultdict(set)
        self._expected: dict[str, OrderedDict[BlockHash, float]] = defaultdict(OrderedDict)
        """worker -> block hash -> when the expectation lapses (oldest first)."""
        self._clock = clock

    def expect(self, worker: str, hashes: Sequence[BlockHash]) -> None:
        """A request with these leading blocks was just routed to worker."""
        exp = self._expected[worker]
        now = self._clock()
        while exp:  # drop lapsed ones, oldest first
            h, until = next(iter(exp.items()))
            if until > now:
                break
            del exp[h]
        for h in hashes:
            if worker not in self._holders.get(h, ()):
                exp[h] = now + EXPECT_TTL_S
                exp.move_to_end(h)

    def stored(self, worker: str, block_hash: BlockHash, tier: Tier = Tier.DEVICE) -> None:
        held = self._holders[block_hash]
        held[worker] = held.get(worker, 0) | (1 << tier)
        self._by_worker[worker].add(block_hash)
        self._expected[worker].pop(block_hash, None)

    def removed(self, worker: str, block_hash: BlockHash, tier: Tier = Tier.DEVICE) -> None:
        """The block left this tier of the worker (it may still be in another)."""
        self._expected[worker].pop(block_hash, None)
        holders = self._holders.get(block_hash)
        if holders is None or worker not in holders:
            return
        holders[worker] &= ~(1 << tier)
        if not holders[worker]:
            del holders[worker]
            self._by_worker[worker].discard(block_hash)
            if not holders:
                del self._holders[block_hash]

    def drop_worker(self, worker: str) -> None:
        for h in self._by_worker.pop(worker, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._holders[h]
        self._expected.pop(worker, None)

    def overlap(self, worker: str, hashes: Sequence[BlockHash]) -> Overlap:
        """The chain's leading blocks this worker holds (by best tier) or is about to
        hold (routed there within EXPECT_TTL_S), in one walk."""
        held = self._holders
        exp = self._expected.get(worker) or {}
        now = self._clock() if exp else 0.0
        by_tier, expected, reported = [0, 0, 0], 0, 0
        for h in hashes:
            tiers = held.get(h, {}).get(worker, 0)
            if tiers:
                by_tier[(tiers & -tiers).bit_length() - 1] += 1  # the lowest bit: best tier
                if not expected:  # no expected-only block before this one
                    reported += 1
            elif exp.get(h, 0.0) > now:
                expected += 1
            else:
                break
        return Overlap(tuple(by_tier), expected, reported)
