"""Work at the HTTP edge whose cost depends on the request's content (parsing its JSON,
tokenizing its prompt, rendering its chat template, checking and compiling its output
constraint) runs here, on a few threads, so the event loop only moves bytes: health
checks, streams and every other request go on while a costly one is worked on.

Each kind of work has a size budget where it is submitted (the body's, the prompt's,
the constraint's) and, where its cost can still grow past that, a time budget of its
own (engine/guided's compile and search budgets). A pool takes at most ``backlog``
items waiting; one more is a 429, so a flood of costly requests cannot queue without
bound. The constraint pool is apart from the parsing pool, so requests without a
constraint never wait behind costly ones.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from router.http.errors import APIError

T = TypeVar("T")


class EdgeWork:
    def __init__(self, name: str, threads: int, backlog: int) -> None:
        self.name = name
        self.backlog = backlog
        self.pending = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"edge-{name}")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the pool. APIError 429 when ``backlog`` items are already
        waiting or running. Cancelled: an item not started is dropped; one running
        finishes within its own budget and its result is dropped."""
        if self.pending >= self.backlog:
            raise APIError(429, f"the router is busy with {self.pending} requests' "
                                f"{self.name} work; retry later", "rate_limit_error",
                           headers={"retry-after": "1"})
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
