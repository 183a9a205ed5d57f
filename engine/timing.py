"""The one timer the engine's start-up measurements share (kernel and compile choices)."""
from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], reps: int = 3, warmup: int = 0) -> float:
    """Best wall time of ``reps`` calls after ``warmup`` untimed ones (the best, not the
    mean: other tenants of a shared host only ever add time)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
