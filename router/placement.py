"""Pick a worker: prefix overlap against load, or round robin for comparison."""
from __future__ import annotations

import itertools
from typing import Sequence

from core.kv import BlockHash
from router.prefix_index import PrefixIndex
from router.workers import Worker

# Score = cached blocks - LOAD_WEIGHT * (requests in flight + waiting) - KV_WEIGHT * usage.
# A worker with 2 more requests queued must hold 1 more cached block to be preferred.
# A worker whose last reported free blocks cannot hold the request's uncached part
# is passed over while another can (FULL_PENALTY).
LOAD_WEIGHT = 0.5
KV_WEIGHT = 4.0
FULL_PENALTY = 1000.0


class Placer:
    def __init__(self, policy: str, index: PrefixIndex) -> None:
        self.policy = policy
        self.index = index
        self._rr = itertools.count()

    def choose(self, workers: Sequence[Worker], hashes: Sequence[BlockHash],
               need_blocks: int = 0) -> tuple[Worker, int]:
        """(worker, its cached leading blocks of this prompt as reported by its KV
        events). workers is non-empty; need_blocks: KV blocks the whole context takes.
        The prefix policy also counts blocks of requests just routed to a worker
        (PrefixIndex.expect), so a burst sharing a prefix lands together."""
        turn = next(self._rr)
        if self.policy == "round_robin":
            w = workers[turn % len(workers)]
            return w, self.index.overlap(w.address, hashes)[0]
        best, best_key = None, None
        for i, w in enumerate(workers):
            reported, overlap = self.index.overlap(w.address, hashes)
            score = (overlap - LOAD_WEIGHT * (w.inflight + w.load.num_waiting)
                     - KV_WEIGHT * w.load.kv_usage)
            if w.load.total_blocks and w.load.free_blocks < need_blocks - overlap:
                score -= FULL_PENALTY
            key = (score, -((i - turn) % len(workers)))  # ties rotate
            if best_key is None or key > best_key:
                best, best_key = (w, reported), key
        self.index.expect(best[0].address, hashes)
        return best
