"""Placement: prefix overlap against load, and expectations for requests just routed."""
from __future__ import annotations

from router.placement import Placer
from router.prefix_index import EXPECT_TTL_S, PrefixIndex
from router.workers import Worker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def workers(n: int) -> list[Worker]:
    return [Worker(f"127.0.0.1:{5000 + i}", "prefill", None, None) for i in range(n)]


def test_reported_blocks_win_over_an_empty_worker() -> None:
    index = PrefixIndex()
    ws = workers(2)
    for h in (1, 2, 3):
        index.stored(ws[1].address, h)
    w, overlap = Placer("prefix", index).choose(ws, [1, 2, 3, 4])
    assert (w, overlap) == (ws[1], 3)


def test_a_burst_sharing_a_prefix_follows_the_first_request() -> None:
    """Nothing is reported yet: the second request of the burst goes where the first
    went, not to the idle worker, and its reported overlap stays 0 (nothing stored)."""
    clock = Clock()
    index, ws = PrefixIndex(clock), workers(2)
    placer = Placer("prefix", index)
    first, _ = placer.choose(ws, [10, 11, 12])
    first.inflight += 1
    second, overlap = placer.choose(ws, [10, 11, 12, 13])
    assert second is first and overlap == 0
    other, _ = placer.choose(ws, [20, 21])  # a different prefix balances to the idle one
    assert other is not first


def _walk(index: PrefixIndex, worker: str, hashes: list[int]) -> tuple[int, int]:
    """(reported leading blocks, reported or expected leading blocks)."""
    o = index.overlap(worker, hashes)
    return o.reported, o.blocks


def test_expectations_lapse_and_yield_to_reports() -> None:
    clock = Clock()
    index = PrefixIndex(clock)
    index.expect("a", [1, 2])
    assert _walk(index, "a", [1, 2]) == (0, 2)
    index.removed("a", 1)  # evicted before it was reported as stored: not expected any more
    assert _walk(index, "a", [1, 2]) == (0, 0)
    index.stored("a", 1)
    assert _walk(index, "a", [1, 2]) == (1, 2)
    index.stored("a", 3)  # held, but after an expected block: not a reported prefix
    assert _walk(index, "a", [1, 2, 3]) == (1, 3)
    clock.t = EXPECT_TTL_S + 1
    assert _walk(index, "a", [1, 2]) == (1, 1)
    index.expect("a", [4])  # lapsed entries are dropped as new ones come
    assert list(index._expected["a"]) == [4]
    index.drop_worker("a")
    assert _walk(index, "a", [1, 2, 3]) == (0, 0)


def test_round_robin_ignores_the_index() -> None:
    index, ws = PrefixIndex(), workers(3)
    for h in (1, 2):
        index.stored(ws[2].address, h)
    placer = Placer("round_robin", index)
    picks = [placer.choose(ws, [1, 2])[0] for _ in range(6)]
    assert picks == ws + ws
