"""The model's collectives at --tensor-parallel-size > 1: the one place the sharded
layers (engine/parallel/shard.py) call torch.distributed, and the timer a benchmark
turns on around them (bench/tp_allreduce.py).

The timer is off unless ``timing_collectives()`` is open in this process; off, a call
costs one module-global read more than the bare collective. It times this rank only:
a collective's time includes waiting for the slowest rank to reach it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass
class CollectiveTimer:
    """What this rank's model collectives cost while the timer is on."""

    calls: int = 0
    """Collectives run (all-reduces and all-gathers)."""
    seconds: float = 0.0
    """Wall time inside them, this rank's clock."""
    bytes: int = 0
    """Bytes of this rank's tensor handed to each (an all-gather's local shard)."""

    def reset(self) -> None:
        self.calls, self.seconds, self.bytes = 0, 0.0, 0

    @contextlib.contextmanager
    def timed(self, t: torch.Tensor) -> Iterator[None]:
        """On CUDA the work before the collective is finished first and the collective
        itself waited for (NCCL runs asynchronously), so the time is the collective's."""
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.bytes += t.numel() * t.element_size()


_timer: CollectiveTimer | None = None
"""The open timer, where a benchmark opened one (None: collectives run bare)."""


@contextlib.contextmanager
def timing_collectives() -> Iterator[CollectiveTimer]:
    """Time every model collective of this process until the block ends; refuses
    nesting (one timer at a time)."""
    global _timer
    if _timer is not None:
        raise RuntimeError("timing_collectives() is already open in this process")
    _timer = CollectiveTimer()
    try:
        yield _timer
    finally:
        _timer = None


def all_reduce(x: torch.Tensor) -> None:
    """Sum x over the ranks, in place."""
    if _timer is None:
        dist.all_reduce(x)
        return
    with _timer.timed(x):
        dist.all_reduce(x)


def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's x (same shape on all), in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    if _timer is None:
        dist.all_gather(parts, x)
        return parts
    with _timer.timed(x):
        dist.all_gather(parts, x)
    return parts
