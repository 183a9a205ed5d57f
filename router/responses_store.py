"""Stored responses for /v1/responses' previous_response_id: each response's
conversation (its input messages and its output, as chat messages), kept per API key
(its name: a rotated key keeps them) for a TTL, at most so many per key and in all.

A key reads only its own entries: another key's id, an expired one and an unknown
one are all "not found" (a 400 naming previous_response_id), so nobody learns
whether an id exists elsewhere. Only the event loop touches it: no lock.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from core.errors import FieldError

TTL_S = 3600.0
"""How long a stored response can be continued."""
MAX_PER_KEY = 256
MAX_TOTAL = 4096
"""Oldest entries go first past either bound (the key's own, then anyone's)."""


class ResponseStore:
    def __init__(self, ttl_s: float = TTL_S, max_per_key: int = MAX_PER_KEY,
                 max_total: int = MAX_TOTAL) -> None:
        self.ttl_s, self.max_per_key, self.max_total = ttl_s, max_per_key, max_total
        self._entries: OrderedDict[tuple[str, str], tuple[float, list[dict]]] = OrderedDict()
        self._per_key: dict[str, int] = {}

    def put(self, key: str, response_id: str, messages: list[dict]) -> None:
        self._expire()
        if self._per_key.get(key, 0) >= self.max_per_key:
            self._drop(next(k for k in self._entries if k[0] == key))
        if len(self._entries) >= self.max_total:
            self._drop(next(iter(self._entries)))
        self._entries[(key, response_id)] = (time.monotonic() + self.ttl_s, messages)
        self._per_key[key] = self._per_key.get(key, 0) + 1

    def get(self, key: str, response_id: str) -> list[dict]:
        """The conversation up to and including that response; FieldError otherwise."""
        self._expire()
        entry = self._entries.get((key, response_id))
        if entry is None:
            raise FieldError("previous_response_id", f"previous_response_id: no response "
                                                     f"{response_id!r} is stored for this API "
                                                     f"key (unknown, expired after "
                                                     f"{self.ttl_s:g} s, or stored with "
                                                     "store false)")
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            k, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                return
            self._drop(k)

    def _drop(self, k: tuple[str, str]) -> None:
        del self._entries[k]
        self._per_key[k[0]] -= 1
        if not self._per_key[k[0]]:
            del self._per_key[k[0]]
