"""Which worker holds which KV blocks, from the workers' KV event streams."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from engine.kv_cache import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = defaultdict(set)
        self._by_worker: dict[str, set[BlockHash]] = defaultdict(set)

    def stored(self, worker: str, block_hash: BlockHash) -> None:
        self._holders[block_hash].add(worker)
        self._by_worker[worker].add(block_hash)

    def removed(self, worker: str, block_hash: BlockHash) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]
        self._by_worker[worker].discard(block_hash)

    def drop_worker(self, worker: str) -> None:
        for h in self._by_worker.pop(worker, set()):
            self.removed(worker, h)

    def overlap(self, worker: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the chain this worker holds."""
        n = 0
        for h in hashes:
            if worker not in self._holders.get(h, ()):
                break
            n += 1
        return n
