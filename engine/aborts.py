"""Aborts that overtake their request.

A caller that gives up on a request cancels its call and sends Abort, on two gRPC
streams that the server may handle in either order (a cancellation is not delivered
to a handler at once either): the Abort can run before the request it names has
reached the engine. Forgotten, that request would then run as if nothing had
happened, and a prefill's blocks stay leased to nobody until the lease expires.
So an Abort of an id the engine does not know is remembered for a while, and the
request that arrives under that id afterwards is refused (AbortedBeforeArrival).

An Abort of an id that ended a moment ago is not remembered (the usual late Abort
of a request that just finished), so an id reused after its request ended is
served. Both memories are bounded: the oldest entries go first.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from engine.request import AbortedBeforeArrival

REMEMBER_S = 60.0
"""How long an early Abort waits for its request (far beyond any network reordering)."""
CAPACITY = 4096
"""Ids each memory holds at most."""


class AbortMemory:
    """Engine-thread bookkeeping (LLMEngine owns one); not thread-safe."""

    def __init__(self, remember_s: float = REMEMBER_S, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remember_s, self.capacity, self._clock = remember_s, capacity, clock
        self._early: OrderedDict[str, float] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()

    def ended(self, request_id: str) -> None:
        """request_id's request finished or was freed here."""
        self._ended[request_id] = None
        self._ended.move_to_end(request_id)
        if len(self._ended) > self.capacity:
            self._ended.popitem(last=False)

    def aborted_unknown(self, request_id: str) -> None:
        """An Abort for an id not live here: remembered unless that id just ended."""
        if request_id in self._ended:
            return
        self._early[request_id] = self._clock()
        self._early.move_to_end(request_id)
        while len(self._early) > self.capacity:
            self._early.popitem(last=False)

    def check_admission(self, request_id: str) -> None:
        """AbortedBeforeArrival when an Abort for this id came first (the memory of it is
        used up); the id is then free again."""
        at = self._early.pop(request_id, None)
        ago = None if at is None else self._clock() - at
        if ago is not None and ago <= self.remember_s:
            raise AbortedBeforeArrival(
                f"request {request_id!r} was aborted before it arrived (an Abort for this "
                f"id came {ago:.3f}s earlier); not running it")

    def __len__(self) -> int:
        return len(self._early)
