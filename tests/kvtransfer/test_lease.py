"""LeaseTable: the source's bookkeeping of pinned blocks (no bytes move here)."""
from __future__ import annotations

import threading

import pytest

from kvtransfer.base import LeaseError
from kvtransfer.lease import LeaseTable, ReleaseReason


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock):
    t = LeaseTable(clock=clock)
    yield t
    assert t.active() == 0, "leak: a lease outlived its test"


def test_grant_then_release_returns_blocks_once(table: LeaseTable) -> None:
    lease = table.grant("r1", [4, 5, 6], ttl_s=10)
    assert lease.block_ids == (4, 5, 6) and lease.request_id == "r1"
    assert table.active() == 1
    table.check_readable("r1", lease.epoch, lease.token, [5, 6])
    assert table.release("r1", lease.epoch, lease.token) == [4, 5, 6]
    assert table.release("r1", lease.epoch, lease.token) is None  # duplicate: no-op
    assert table.release_with_reason("r1", lease.epoch, lease.token) == (None, ReleaseReason.DUPLICATE)


def test_unknown_and_wrong_epoch_release_are_noops(table: LeaseTable) -> None:
    assert table.release_with_reason("nope", 1, "x") == (None, ReleaseReason.UNKNOWN)
    lease = table.grant("r1", [1], ttl_s=10)
    assert table.release_with_reason("r1", lease.epoch + 7, lease.token) == (None, ReleaseReason.EPOCH_MISMATCH)
    assert table.active() == 1
    assert table.release("r1", lease.epoch, lease.token) == [1]


def test_epochs_strictly_increase(table: LeaseTable) -> None:
    epochs, first = [], None
    for i in range(50):
        lease = table.grant(f"r{i}", [i], ttl_s=10)
        first = first or lease
        epochs.append(lease.epoch)
        assert table.release(f"r{i}", lease.epoch, lease.token) == [i]
    assert all(a < b for a, b in zip(epochs, epochs[1:]))
    again = table.grant("r0", [0], ttl_s=10)  # a re-granted request gets a new epoch
    assert again.epoch > epochs[-1]
    assert table.release("r0", epochs[0], first.token) is None  # the old epoch cannot free the new lease
    assert table.release("r0", again.epoch, again.token) == [0]


def test_expiry_hands_blocks_back_and_late_release_is_noop(table: LeaseTable, clock: FakeClock) -> None:
    short = table.grant("short", [1, 2], ttl_s=1)
    long = table.grant("long", [3], ttl_s=100)
    clock.now += 1.5
    # Past its deadline but not yet reaped: release refuses, expire() frees.
    assert table.release_with_reason("short", short.epoch, short.token) == (None, ReleaseReason.EXPIRED)
    gone = table.expire()
    assert [lease.request_id for lease in gone] == ["short"] and gone[0].block_ids == (1, 2)
    assert table.expire() == []
    assert table.release_with_reason("short", short.epoch, short.token) == (None, ReleaseReason.EXPIRED)
    assert table.release("long", long.epoch, long.token) == [3]


def test_read_after_expiry_fails_loudly(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("r", [7, 8], ttl_s=2)
    clock.now += 2
    with pytest.raises(LeaseError, match="expired"):
        table.check_readable("r", lease.epoch, lease.token, [7])
    table.expire()
    with pytest.raises(LeaseError, match="expired"):
        table.check_readable("r", lease.epoch, lease.token, [7])


@pytest.mark.parametrize("request_id, epoch_delta, blocks, message", [
    ("missing", 0, [7], "no lease"),
    ("r", 1, [7], "epoch"),
    ("r", 0, [7, 9], r"does not cover blocks \[9\]"),
])
def test_check_readable_names_the_problem(table: LeaseTable, request_id: str, epoch_delta: int,
                                          blocks: list[int], message: str) -> None:
    lease = table.grant("r", [7, 8], ttl_s=10)
    with pytest.raises(LeaseError, match=message):
        table.check_readable(request_id, lease.epoch + epoch_delta, lease.token, blocks)
    table.release("r", lease.epoch, lease.token)
    with pytest.raises(LeaseError, match="released"):
        table.check_readable("r", lease.epoch, lease.token, [7])


def test_grant_rejects_bad_arguments(table: LeaseTable) -> None:
    with pytest.raises(ValueError, match="no blocks"):
        table.grant("r", [], ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s"):
        table.grant("r", [1], ttl_s=0)
    lease = table.grant("r", [1], ttl_s=1)
    with pytest.raises(ValueError, match="already holds"):
        table.grant("r", [2], ttl_s=1)
    table.release("r", lease.epoch, lease.token)


def test_concurrent_releases_free_each_block_once(table: LeaseTable) -> None:
    leases = [table.grant(f"r{i}", [i], ttl_s=10) for i in range(200)]
    freed: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for lease in leases:
            blocks = table.release(lease.request_id, lease.epoch, lease.token)
            if blocks:
                with lock:
                    freed.extend(blocks)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(freed) == list(range(200))


def test_a_lease_token_is_required_to_read_or_release(table: LeaseTable) -> None:
    """Security: the request id is client-chosen and the epoch guessable; the lease's own
    random token is what opens it, and a replay after release still gets nothing."""
    lease = table.grant("r", [3, 4], ttl_s=10)
    other = table.grant("o", [5], ttl_s=10)
    assert len(lease.token) == 32 and lease.token != other.token
    for guess in ("", "0" * 32, other.token):
        with pytest.raises(LeaseError, match="wrong lease token"):
            table.check_readable("r", lease.epoch, guess, [3])
        assert table.release_with_reason("r", lease.epoch, guess) == (None, ReleaseReason.UNAUTHORIZED)
    assert table.active() == 2
    assert table.release("r", lease.epoch, lease.token) == [3, 4]
    assert table.release_with_reason("r", lease.epoch, other.token) == (None, ReleaseReason.UNAUTHORIZED)
    assert table.release_with_reason("r", lease.epoch, lease.token) == (None, ReleaseReason.DUPLICATE)
    with pytest.raises(LeaseError, match="released"):
        table.check_readable("r", lease.epoch, lease.token, [3])
    table.release("o", other.epoch, other.token)
