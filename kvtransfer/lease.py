"""Source-side lease bookkeeping: which blocks are pinned for which reader, until when.

Scheduler side only: no bytes move here and no block is freed here. The owner
(the prefill scheduler) frees the block ids that ``release`` and ``expire``
hand back, exactly once each. Thread-safe: one lock guards the table, so the
gRPC Release handler, the data-path threads (``check_readable``) and the
scheduler's reaper may call it concurrently.
"""
from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from kvtransfer.base import LeaseError

_ENDED_MEMORY = 4096
"""Ended leases remembered to tell a duplicate release from an unknown one."""


class ReleaseReason(Enum):
    """What a release found (the ReleaseReply's reason; kvtransfer/link.py converts)."""

    RELEASED = "released"
    """This call ended the live lease."""
    DUPLICATE = "duplicate"
    """Already released."""
    EXPIRED = "expired"
    """The lease expired first."""
    EPOCH_MISMATCH = "epoch_mismatch"
    """The request holds a newer lease."""
    UNKNOWN = "unknown"
    """No such lease (or one ended too long ago to be remembered)."""
    UNAUTHORIZED = "unauthorized"
    """Wrong lease token: nothing ended."""


@dataclass(frozen=True)
class Lease:
    request_id: str
    epoch: int
    """Unique in this table; strictly increasing across grants."""
    deadline: float
    """Expiry on the table's clock (``time.monotonic`` by default), seconds."""
    deadline_unix_ms: int
    """The same instant on the wall clock, for the KVHandle."""
    block_ids: tuple[int, ...]
    token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """The lease's own secret: reads and releases must present it (compared in
    constant time), so a guessed request id and epoch get nothing."""

    def admits(self, token: str) -> bool:
        return hmac.compare_digest(self.token.encode(), (token or "").encode())


class LeaseTable:
    """Leases keyed by request id; at most one live lease per request.

    Epochs start at the wall clock in nanoseconds and increase by one per
    grant, so they stay unique across a worker restart and a stale release
    from before the restart cannot match a new lease.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[tuple[str, int], tuple[ReleaseReason, Lease]] = OrderedDict()
        self._next_epoch = time.time_ns()

    def grant(self, request_id: str, block_ids: Sequence[int], ttl_s: float) -> Lease:
        """Pin ``block_ids`` for ``request_id`` for ``ttl_s`` seconds. Raises
        ValueError if the request already holds a lease (release it first) or
        the arguments are empty/non-positive."""
        if not block_ids:
            raise ValueError(f"lease for {request_id!r}: no blocks")
        if ttl_s <= 0:
            raise ValueError(f"lease for {request_id!r}: ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            held = self._leases.get(request_id)
            if held is not None:
                raise ValueError(f"request {request_id!r} already holds lease epoch {held.epoch}")
            epoch = self._next_epoch
            self._next_epoch += 1
            lease = Lease(request_id, epoch, self._clock() + ttl_s,
                          int((self._wall_clock() + ttl_s) * 1000), tuple(int(b) for b in block_ids))
            self._leases[request_id] = lease
            return lease

    def release(self, request_id: str, epoch: int, token: str) -> list[int] | None:
        """End a live lease: the block ids to free, the first time only. None
        for a duplicate, late (expired), unknown, wrong-epoch or wrong-token
        release, which change nothing (an expired lease stays for ``expire`` to
        hand back)."""
        return self.release_with_reason(request_id, epoch, token)[0]

    def release_with_reason(self, request_id: str, epoch: int, token: str
                            ) -> tuple[list[int] | None, ReleaseReason]:
        """``release`` plus why (the ReleaseReply's reason)."""
        lease, reason = self.end(request_id, epoch, token)
        return (None if lease is None else list(lease.block_ids)), reason

    def drop(self, request_id: str) -> Lease | None:
        """End whatever lease request_id holds, live or expired (its request was
        aborted); the lease, the first time only."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._remember(lease, ReleaseReason.RELEASED)
            return lease

    def end(self, request_id: str, epoch: int, token: str
            ) -> tuple[Lease | None, ReleaseReason]:
        """Like ``release_with_reason``, returning the ended lease itself."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.epoch != epoch:
                how, ended = self._ended.get((request_id, epoch), (None, None))
                if ended is not None:
                    if not ended.admits(token):
                        return None, ReleaseReason.UNAUTHORIZED
                    # how it ended: released (so this is a duplicate) or expired
                    return None, (ReleaseReason.DUPLICATE if how is ReleaseReason.RELEASED
                                  else how)
                return None, (ReleaseReason.UNKNOWN if lease is None
                              else ReleaseReason.EPOCH_MISMATCH)
            if not lease.admits(token):
                return None, ReleaseReason.UNAUTHORIZED
            if self._clock() >= lease.deadline:
                return None, ReleaseReason.EXPIRED
            del self._leases[request_id]
            self._remember(lease, ReleaseReason.RELEASED)
            return lease, ReleaseReason.RELEASED

    def expire(self, now: float | None = None) -> list[Lease]:
        """Remove every lease whose deadline is at or before ``now`` (default:
        the table clock) and return them; the caller frees their blocks."""
        now = self._clock() if now is None else now
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.deadline <= now]
            for lease in gone:
                del self._leases[lease.request_id]
                self._remember(lease, ReleaseReason.EXPIRED)
            return gone

    def check_readable(self, request_id: str, epoch: int, token: str,
                       block_ids: Sequence[int]) -> None:
        """Raise LeaseError unless a live lease ``(request_id, epoch)`` with this token
        covers every id in ``block_ids``; a read after expiry or release fails here,
        loudly."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.epoch != epoch:
                how, ended = self._ended.get((request_id, epoch), (None, None))
                if ended is not None and ended.admits(token):
                    raise LeaseError(f"lease {request_id!r} epoch {epoch} was {how.value}")
                if lease is None:
                    raise LeaseError(f"no lease for request {request_id!r}")
                raise LeaseError(f"lease {request_id!r}: epoch {epoch} != live epoch {lease.epoch}")
            if not lease.admits(token):
                raise LeaseError(f"lease {request_id!r} epoch {epoch}: wrong lease token")
            if self._clock() >= lease.deadline:
                raise LeaseError(f"lease {request_id!r} epoch {epoch} expired")
            outside = sorted(set(int(b) for b in block_ids) - set(lease.block_ids))
            if outside:
                raise LeaseError(f"lease {request_id!r} epoch {epoch} does not cover blocks {outside}")

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    def active(self) -> int:
        """Leases not yet released or expired (0 once idle: the leak check)."""
        with self._lock:
            return len(self._leases)

    def _remember(self, lease: Lease, how: ReleaseReason) -> None:
        """how: RELEASED or EXPIRED."""
        self._ended[(lease.request_id, lease.epoch)] = (how, lease)
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
