"""Which worker holds which KV blocks, from the workers' KV event streams, plus
the blocks of requests just routed to a worker and not yet reported by it.

Without the second part, requests that share a prefix and arrive together all look
like misses (the first one's blocks are not computed yet) and spread over the pool;
with it, they follow the first one, as SGLang's cache-aware router does by inserting
at routing time. An expectation ends when the worker reports the block (stored or
removed) or after EXPECT_TTL_S."""
from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from typing import Callable, Sequence

from core.kv import BlockHash

EXPECT_TTL_S = 60.0


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[BlockHash, set[str]] = defaultdict(set)
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

    def stored(self, worker: str, block_hash: BlockHash) -> None:
        self._holders[block_hash].add(worker)
        self._by_worker[worker].add(block_hash)
        self._expected[worker].pop(block_hash, None)

    def removed(self, worker: str, block_hash: BlockHash) -> None:
        self._expected[worker].pop(block_hash, None)
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]
        self._by_worker[worker].discard(block_hash)

    def drop_worker(self, worker: str) -> None:
        for h in self._by_worker.pop(worker, set()):
            self.removed(worker, h)
        self._expected.pop(worker, None)

    def overlap(self, worker: str, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """(leading blocks of the chain this worker reported holding, leading blocks it
        holds or is about to: routed there within EXPECT_TTL_S), in one walk."""
        held = self._holders
        exp = self._expected.get(worker) or {}
        now = self._clock() if exp else 0.0
        reported = n = 0
        for h in hashes:
            if worker in held.get(h, ()):
                if reported == n:  # no expected-only block before this one
                    reported += 1
            elif exp.get(h, 0.0) <= now:
                break
            n += 1
        return reported, n
