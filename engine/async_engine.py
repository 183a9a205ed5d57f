"""An LLMEngine on its own thread, driven from asyncio.

The engine is built *on* its thread (torch's OpenMP pool then lives on the
thread that runs the model; building it elsewhere made every small op pay a
futex wake-up). Callers never touch the engine directly: ``call`` runs a
function on the engine thread between steps and awaits its result, and each
request's outputs arrive on its own asyncio queue. Prefix-cache events are
handed to ``on_events`` after every step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from engine.llm_engine import LLMEngine
from engine.request import RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine],
                 on_events: Callable[[list], None] | None = None,
                 on_step: Callable[[LLMEngine], None] | None = None) -> None:
        self._build = build
        self._on_events = on_events
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.engine: LLMEngine | None = None
        """Read-only use from other threads (config, tokenizer); mutate via call()."""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine",
                                        daemon=True)
        self._thread.start()
        await ready

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def call(self, fn: Callable[..., Any], *args: Any, urgent: int | None = None) -> Any:
        """Run fn(engine, *args) on the engine thread; return or raise its result.
        urgent: the priority of the request fn queues; a step of only less important
        requests is then cut short (LLMEngine.interrupt_for) instead of finishing first."""
        fut = self._loop.create_future()
        self._commands.put((fn, args, fut))
        if urgent is not None and self.engine is not None:
            self.engine.interrupt_for(urgent)
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """The queue a request's outputs will be delivered to (open it before adding)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- engine thread ------------------------------------------------------------
    def _run(self, ready: asyncio.Future) -> None:
        try:
            self.engine = self._build()
        except BaseException as e:  # noqa: BLE001 - report any build failure to start()
            self._loop.call_soon_threadsafe(_settle, ready, None, e)
            return
        self._loop.call_soon_threadsafe(_settle, ready, None, None)
        while not self._stopped.is_set():
            busy = self.engine.has_unfinished()
            self._run_commands(block=not busy)
            if self.engine.has_unfinished():
                outs = self.engine.step()
                if outs:
                    self._loop.call_soon_threadsafe(self._deliver, outs)
            events = self.engine.kv.pool.drain_events()
            if events and self._on_events is not None:
                self._on_events(events)
            if self._on_step is not None:
                self._on_step(self.engine)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, fut = item
            try:
                result, error = fn(self.engine, *args), None
            except Exception as e:  # noqa: BLE001 - the caller gets it
                result, error = None, e
            self._loop.call_soon_threadsafe(_settle, fut, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
