"""The one timer the engine's start-up measurements share (kernel and compile choices),
and the check that tells whether a measurement had its cores to itself."""
from __future__ import annotations

import time
from typing import Callable


def best_pair(a: Callable[[], object], b: Callable[[], object], reps: int = 3,
              warmup: int = 0, retry_if: Callable[[float, float], bool] | None = None
              ) -> tuple[float, float]:
    """Best wall times (seconds) of ``a`` and ``b``, timed in turn (a, b, a, b, ...) after
    ``warmup`` untimed calls of each. The best, not the mean: other tenants of a shared
    host only ever add time. In turn, so load from another tenant (a second worker
    loading its model beside this one) slows both alike, where timing every call of one
    before the other would charge a burst to one side. When ``retry_if(best_a, best_b)``
    holds (the outcome that would switch a path off), both are timed again, twice as
    many times, and the best of all kept: a burst that spoilt the first round must then
    spoil the second as well."""
    for _ in range(warmup):
        a()
        b()
    best = [float("inf"), float("inf")]
    for n in (reps, 2 * reps):
        for _ in range(n):
            for i, fn in enumerate((a, b)):
                t0 = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t0)
        if retry_if is None or not retry_if(best[0], best[1]):
            break
    return best[0], best[1]


class CpuShare:
    """The share of the CPU time a stretch of work's threads could have had that they
    got: the process's CPU time (every thread) over the wall time times ``threads``.
    torch's threads spin between kernel calls, so a pass of kernels alone on its cores
    gets about 1 (0.97-1.0 measured on a 2-core AMD EPYC), and one beside another busy
    process much less (0.75 beside one benchmark at nice 5): a measurement that will be
    kept should be taken at a share near 1. ``share`` is set on leaving the block."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.share = 1.0

    def __enter__(self) -> CpuShare:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        self.share = (time.process_time() - self._cpu) / (wall * self.threads) if wall > 0 else 1.0
