"""How requests are offered: open loop (Poisson arrivals at a rate, or an explicit
arrival schedule) or closed loop (a fixed number of clients, each sending its next
request when the previous one ends)."""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx

from tandem.bench.client import Endpoint, RequestResult, send
from tandem.bench.datasets import BenchRequest


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests arriving as a Poisson process
    of the given rate (req/s): exponential gaps of mean 1/rate, the first at its first
    gap. rate = inf sends everything at t=0."""
    if rate <= 0:
        raise ValueError(f"--rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass
class LoadResult:
    """One run: the per-request results (in request order) and its wall time."""

    label: str
    results: list[RequestResult]
    duration_s: float
    """From the first send to the last response."""
    rate: float | None = None
    concurrency: int | None = None
    meta: dict = field(default_factory=dict)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc or "bench", unit="req", disable=not enabled,
                dynamic_ncols=True, leave=False)


async def run_load(endpoint: Endpoint, requests: Sequence[BenchRequest], *,
                   rate: float | None = None, concurrency: int | None = None,
                   arrivals: Sequence[float] | None = None, seed: int = 0,
                   label: str = "", progress: bool = True) -> LoadResult:
    """Send every request once.

    * ``concurrency`` alone: closed loop with that many clients.
    * ``rate`` (req/s, may be inf): open loop, Poisson arrivals seeded by ``seed``;
      ``concurrency`` then caps the requests in flight (later arrivals wait).
    * ``arrivals``: open loop on this explicit schedule (seconds from the start).
    """
    n = len(requests)
    if arrivals is None and rate is None and concurrency is None:
        raise ValueError("give --rate, --concurrency or an arrival schedule")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if arrivals is not None and len(arrivals) != n:
        raise ValueError("one arrival time per request expected")
    results: list[RequestResult | None] = [None] * n
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = _progress(n, label, progress)
    async with httpx.AsyncClient(limits=limits, timeout=endpoint.timeout_s) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            results[i] = await send(client, endpoint, requests[i])
            bar.update(1)

        if arrivals is None and rate is None:  # closed loop
            queue = iter(range(n))

            async def worker() -> None:
                for i in queue:  # a shared iterator: each index is taken once
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
        else:
            times = list(arrivals) if arrivals is not None else poisson_arrivals(n, rate, seed)
            cap = asyncio.Semaphore(concurrency) if concurrency else None

            async def timed(i: int) -> None:
                delay = t0 + times[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if cap is None:
                    await one(i)
                else:
                    async with cap:
                        await one(i)

            await asyncio.gather(*(timed(i) for i in range(n)))
        t1 = time.perf_counter()
    bar.close()
    done = [r for r in results if r is not None]
    start = min((r.sent for r in done), default=t0)
    end = max((r.ended for r in done), default=t1)
    return LoadResult(label, done, max(end - start, 1e-9), rate, concurrency)


def run(endpoint: Endpoint, requests: Sequence[BenchRequest], **kw) -> LoadResult:
    """run_load from synchronous code."""
    return asyncio.run(run_load(endpoint, requests, **kw))
