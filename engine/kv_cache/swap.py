"""The host swap pool: where a preempted request's KV blocks wait, bookkeeping only.

Same block layout as the device cache, so one block moves as one contiguous
copy. Pinned host memory on CUDA (async copies); a plain second CPU tensor on
CPU. Each swapped request owns its swap blocks exclusively (no sharing, no
prefix caching here); ``free`` returns them. Not thread-safe: the engine thread
owns it.

The host tensor's slots are shared with the host KV tier (engine/kv_cache/tiers):
``HostSlots`` hands them out. The swap pool is guaranteed its own --swap-space: when
the free slots run short it reclaims slots from the tier, whose least recently used
blocks go (to disk where there is a disk tier); the tier never takes a slot the swap
pool holds. So the tier fills the swap space while no request is swapped and gives it
back on demand, and never has less than its own --kv-offload-cpu-gib.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence


class HostSlots:
    """Free slots of the host KV tensor. Slots given back while a step's copies are
    still to run (a swap-in's source, freed at scheduling) wait until ``settle`` (after
    the copies): handed out at once, a slot could be overwritten before it is read."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._settling: list[int] = []
        self.reclaim: Callable[[int], None] | None = None
        """Frees up to n slots held by the host tier (set by the tier)."""
        self.reclaimable: Callable[[], int] = lambda: 0
        """How many slots ``reclaim`` could free now."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_settling(self) -> int:
        return len(self._settling)

    def available(self) -> int:
        """Slots ``take`` can hand out now, reclaiming from the tier included."""
        return len(self._free) + self.reclaimable()

    def take(self, n: int, reclaim: bool = False) -> list[int] | None:
        """n free slots, or None; reclaim=True lets the tier give back slots first."""
        if reclaim and n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def give(self, ids: Sequence[int], settled: bool = True) -> None:
        (self._free if settled else self._settling).extend(ids)

    def settle(self) -> None:
        """The step's copies ran: slots given back unsettled are free again."""
        self._free.extend(self._settling)
        self._settling.clear()


class SwapPool:
    def __init__(self, num_blocks: int, slots: HostSlots | None = None) -> None:
        self.num_blocks = num_blocks
        self.slots = slots or HostSlots(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self._used = 0

    @property
    def num_free(self) -> int:
        """Blocks a preemption can swap out now: its budget left, as far as the shared
        slots can give them."""
        return min(self.num_blocks - self._used, self.slots.available())

    @property
    def num_used(self) -> int:
        return self._used

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        if n > self.num_free or request_id in self.tables:
            return None
        ids = self.slots.take(n, reclaim=True)
        if ids is None:
            return None
        self.tables[request_id] = ids
        self._used += n
        return ids

    def free(self, request_id: str) -> Sequence[int]:
        """Return a request's slots; they are reused only after this step's copies
        (HostSlots.settle): a swap-in reads them in the step that frees them."""
        ids = self.tables.pop(request_id, [])
        self._used -= len(ids)
        self.slots.give(ids, settled=False)
        return ids

    def leak_check(self) -> None:
        if self.tables or self._used:
            raise AssertionError(f"swap pool leak: held by {sorted(self.tables)[:8]}, "
                                 f"{self._used}/{self.num_blocks} used")
