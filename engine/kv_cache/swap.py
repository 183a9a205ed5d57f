"""The host swap pool: where a preempted request's KV blocks wait, bookkeeping only.

Same block layout as the device cache, so one block moves as one contiguous
copy. Pinned host memory on CUDA (async copies); a plain second CPU tensor on
CPU. Each swapped request owns its swap blocks exclusively (no sharing, no
prefix caching here); ``free`` returns them. Not thread-safe: the engine thread
owns it.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


class SwapPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        if n > len(self._free) or request_id in self.tables:
            return None
        ids = [self._free.popleft() for _ in range(n)]
        self.tables[request_id] = ids
        return ids

    def free(self, request_id: str) -> Sequence[int]:
        ids = self.tables.pop(request_id, [])
        self._free.extend(ids)
        return ids

    def leak_check(self) -> None:
        if self.tables or len(self._free) != self.num_blocks:
            raise AssertionError(f"swap pool leak: held by {sorted(self.tables)[:8]}, "
                                 f"{len(self._free)}/{self.num_blocks} free")
