"""The leases each router holds, freed soon after that router is gone.

A prefill reply carries a KVHandle; the router that got it passes it to a decode
worker, which reads the blocks and releases the lease. A router killed between the two
leaves handles nobody will use: without this, their blocks stayed pinned until the
lease's TTL (--lease-ttl-s, 30 s). Each router names itself (its instance id) in every
PrefillRequest (``router_id``) and in the KV event stream it keeps open to every worker
(``KVEventsRequest.subscriber``). When a router's last stream to this worker has stayed
closed for ``GONE_AFTER_S``, the leases its Prefill calls were granted and that are still
live are ended and their blocks freed, whoever was about to read them: a decode worker
reading for that router's request is serving a request whose client connection died
with the router.

A live router whose stream broke reconnects well within that time (router/workers.py
backs off at most 2 s), which cancels the countdown. A Prefill without ``router_id``
(another client, an older router), or from a router that never opened a stream here, is
bounded by the TTL alone, as before.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Callable

log = logging.getLogger(__name__)

GONE_AFTER_S = 5.0
"""Seconds a router's last KV event stream may stay closed before its leases end."""


class RouterLeases:
    """Per router id: its open KV event streams, and the (request id, lease epoch) of
    the leases granted to its Prefill calls. Event loop only."""

    def __init__(self, end: Callable[[str, int, str], bool],
                 gone_after_s: float = GONE_AFTER_S) -> None:
        """end(request_id, epoch, why): end that lease if it is still that epoch's; True
        when it was."""
        self._end = end
        self.gone_after_s = gone_after_s
        self._streams: Counter[str] = Counter()
        self._leases: dict[str, dict[str, int]] = {}
        self._countdowns: dict[str, asyncio.TimerHandle] = {}

    def granted(self, router: str, request_id: str, epoch: int) -> None:
        if router:
            self._leases.setdefault(router, {})[request_id] = epoch

    def opened(self, router: str) -> None:
        if not router:
            return
        self._streams[router] += 1
        countdown = self._countdowns.pop(router, None)
        if countdown is not None:
            countdown.cancel()

    def closed(self, router: str) -> None:
        if not router or self._streams[router] == 0:
            return
        self._streams[router] -= 1
        if self._streams[router] == 0:
            del self._streams[router]
            self._countdowns[router] = asyncio.get_running_loop().call_later(
                self.gone_after_s, self._gone, router)

    def prune(self, live: Callable[[str, int], bool]) -> None:
        """Forget leases that ended by other paths (released, expired, aborted)."""
        for router in list(self._leases):
            leases = self._leases[router]
            for rid, epoch in list(leases.items()):
                if not live(rid, epoch):
                    del leases[rid]
            if not leases:
                del self._leases[router]

    def held(self, router: str) -> int:
        """Leases recorded for router (tests, logs)."""
        return len(self._leases.get(router, ()))

    def _gone(self, router: str) -> None:
        self._countdowns.pop(router, None)
        why = f"router {router} is gone"
        ended = sum(self._end(rid, epoch, why)
                    for rid, epoch in self._leases.pop(router, {}).items())
        if ended:
            log.warning("router %s has had no KV event stream open here for %.0f s: ended "
                        "%d lease%s its prefills left", router, self.gone_after_s, ended,
                        "" if ended == 1 else "s")
