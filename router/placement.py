"""Pick a worker: prefix overlap against load, or round robin for comparison."""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from core.kv import BlockHash
from router.prefix_index import Overlap, PrefixIndex, Tier
from router.workers import Worker

# Score = sum over the prompt's leading cached blocks of TIER_WEIGHT[tier]
#         - LOAD_WEIGHT * (requests in flight + waiting) - KV_WEIGHT * usage.
# A worker with 2 more requests queued must hold 1 more cached device block to be
# preferred. A block in a lower tier is worth less than one on the device, since it
# must be promoted first, but far more than a miss, which is recomputed:
#   device 1.0  (already there; also a block just routed there, PrefixIndex.expect)
#   host   0.8  (a block-sized copy from host memory, no forward pass)
#   disk   0.5  (a file read and a checksum, then the host copy)
# so at equal load a device hit beats a host hit beats a disk hit beats a miss, and a
# host hit of 4 blocks (3.2) outweighs a queue 2 requests longer (1.0) and a device
# hit of 3 (3.0).
# A worker whose last reported free blocks cannot hold the request's part not already
# on its device (a lower tier's hit needs device blocks to be promoted into) is passed
# over while another can (FULL_PENALTY).
TIER_WEIGHT = {Tier.DEVICE: 1.0, Tier.HOST: 0.8, Tier.DISK: 0.5}
LOAD_WEIGHT = 0.5
KV_WEIGHT = 4.0
FULL_PENALTY = 1000.0


def cache_score(o: Overlap) -> float:
    """What a worker's cached prefix of the prompt is worth (TIER_WEIGHT)."""
    held = sum(TIER_WEIGHT[t] * n for t, n in zip(Tier, o.by_tier))
    return held + TIER_WEIGHT[Tier.DEVICE] * o.expected


class Placer:
    def __init__(self, policy: str, index: PrefixIndex) -> None:
        self.policy = policy
        self.index = index
        self._rr = itertools.count()

    def choose(self, workers: Sequence[Worker],
               hashes: Sequence[BlockHash] | Callable[[Worker], Sequence[BlockHash]],
               need_blocks: int = 0) -> tuple[Worker, int]:
        """(worker, its cached leading blocks of this prompt as reported by its KV
        events, in any tier). workers is non-empty; need_blocks: KV blocks the whole context takes.
        hashes: the prompt's block hashes, or each worker's (a LoRA adapter's salt is its
        identity on that worker). The prefix policy also counts blocks of requests just
        routed to a worker (PrefixIndex.expect), so a burst sharing a prefix lands together."""
        chain = hashes if callable(hashes) else (lambda _: hashes)
        turn = next(self._rr)
        if self.policy == "round_robin":
            w = workers[turn % len(workers)]
            return w, self.index.overlap(w.address, chain(w)).reported
        best, best_key = None, None
        for i, w in enumerate(workers):
            overlap = self.index.overlap(w.address, chain(w))
            score = (cache_score(overlap) - LOAD_WEIGHT * (w.inflight + w.load.num_waiting)
                     - KV_WEIGHT * w.load.kv_usage)
            if w.load.total_blocks and w.load.free_blocks < need_blocks - overlap.on_device:
                score -= FULL_PENALTY
            key = (score, -((i - turn) % len(workers)))  # ties rotate
            if best_key is None or key > best_key:
                best, best_key = (w, overlap.reported), key
        self.index.expect(best[0].address, chain(best[0]))
        return best
