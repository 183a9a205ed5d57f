"""The engine thread's driver: the typed boundary between a worker service and its
engine.

An ``EngineWorker`` runs one LLMEngine on a dedicated thread and is the only way a
service (and a KV connector's worker side, engine/kv_connector.py) touches it: each
coroutine below runs its work on the engine thread between steps and returns the
result to the event loop. It uses the engine's public methods only. Nothing reads
engine state from another thread; what is fixed at build time (``info``) and the
load snapshot the engine thread publishes after every iteration (``load``) are plain
values.

The engine is built *on* its thread (torch's OpenMP pool then lives on the thread
that runs the model; building it elsewhere made every small op pay a futex wake-up).

Building a request (``make_request``) whose cost depends on its content (compiling
and searching a constraint, replaying outputs made elsewhere) runs on a small pool of
its own threads, never on the event loop: health checks, Release and every stream go
on meanwhile (the constraint's budgets, core/guided/budget.py, bound each build).

Streams: ``add`` opens the request's output queue atomically with the id check, so
two requests under one id can never share a queue or a block table (the second gets
DuplicateRequestError). A request's outputs, its abort included,
arrive on its queue; the queue is the caller's to close.

Failure: a step that raises fails its requests inside the engine (LLMEngine.step).
If the engine thread dies anyway, every pending call and stream gets EngineDead, so
does whatever waits through the connector (``KVConnector.engine_stopped``), ``alive``
turns False and ``on_death`` runs on the event loop (the services turn health
NOT_SERVING and exit non-zero).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from core.kv import BlockHash
from engine.kv_cache.tiers.events import TierEvent
from engine.llm_engine import LLMEngine
from engine.request import (AbortedBeforeArrival, DuplicateRequestError, FinishReason, Request,
                            RequestOutput)
from core.sampling import SamplingParams
from engine.status import EngineInfo, EngineLoad

log = logging.getLogger(__name__)

BUILD_THREADS = 2
"""Threads that build constrained or resumed requests. Their own pool, not the loop's
default executor: a flood of costly constraints queues here, behind each other, and
not in front of what else uses the default one (DNS lookups when dialing a KV peer)."""

__all__ = ["AbortedBeforeArrival", "DuplicateRequestError", "EngineDead", "EngineInfo",
           "EngineLoad", "EngineWorker"]


class EngineDead(RuntimeError):
    """The engine thread has stopped; nothing more can run on it."""


class EngineWorker:
    def __init__(self, build: Callable[[], LLMEngine],
                 on_events: Callable[[list[TierEvent]], None] | None = None,
                 on_step: Callable[[LLMEngine], None] | None = None,
                 on_load: Callable[[EngineLoad], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """on_events, on_step and on_load run on the engine thread (keep them cheap and
        thread-safe); on_death runs on the event loop."""
        self._build = build
        self._on_events, self._on_step, self._on_load = on_events, on_step, on_load
        self._on_death = on_death
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._engine: LLMEngine | None = None
        self._dead: BaseException | None = None
        self.info: EngineInfo | None = None
        self.load = EngineLoad()
        self.kv_tensor = None
        """The paged KV tensor, for registering with a KV transfer backend (the backend's
        readers and the model write disjoint blocks; the KV connector says which)."""
        self._builders = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="build-request")

    # -- life ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine",
                                        daemon=True)
        self._thread.start()
        await ready

    def stop(self) -> None:
        self._builders.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    # -- requests -----------------------------------------------------------------------
    async def make_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                           request_id: str, priority: int = 0,
                           output_token_ids: Sequence[int] = (), cache_salt: bytes = b"",
                           lora: str = "", kv_policy: str | None = None) -> Request:
        """Validate and build a request (ValueError naming the field). Reads only fixed
        configuration, so it runs off the engine thread: here for a plain request (its
        cost is bounded by the context window), on the build pool when it has a
        constraint or outputs to replay. Cancelled: nothing is held yet; a build in
        flight ends within its budget and its request is dropped."""
        if not request_id:
            raise ValueError("request_id is empty")
        engine = self._engine

        def build() -> Request:
            return engine.make_request(list(prompt_ids), params, request_id, priority,
                                       list(output_token_ids), cache_salt, lora, kv_policy)
        if params.guided is None and not output_token_ids:
            return build()
        return await asyncio.get_running_loop().run_in_executor(self._builders, build)

    async def add(self, req: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; returns its output queue. DuplicateRequestError when the id
        is live here, AbortedBeforeArrival when an Abort for it came first."""
        q = self._open(req.request_id)
        try:
            await self._call(lambda e: e.admit(req), urgent=req.priority)
        except BaseException:
            self._close_if(req.request_id, q)
            self._fire(lambda e: e.abort_if_admitted(req))  # cancelled: it may run later
            raise
        return q

    async def finish_loading(self, request_id: str, loaded: bool) -> None:
        """The KV write into a loading request's blocks is over (its owner says so; see
        LLMEngine.finish_loading); an abort that waited for it reaches the stream."""
        out = await self._call(lambda e: e.finish_loading(request_id, loaded), urgent=None)
        if out is not None:
            self._deliver([out])

    async def abort(self, request_id: str, owner: bool = False) -> bool:
        """Cancel a request (blocks the connector keeps too); its stream gets the abort
        output. owner=True: the caller owns the request's load and no write is in
        flight. True when the id was live here."""
        known, outs = await self._call(lambda e: (e.has_request(request_id),
                                                  e.abort_request(request_id, owner)))
        self._deliver(outs)
        return known

    def abort_soon(self, request_id: str) -> None:
        """abort(owner=True) without waiting: for cleanup paths that must not await."""
        self._fire(lambda e: e.abort_request(request_id, owner=True))

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- LoRA adapters ------------------------------------------------------------------
    @property
    def loras(self):
        """The engine's LoRA adapters by name (engine/lora/registry.py LoRARegistry, which
        any thread may use), None without LoRA."""
        return self._engine.loras if self._engine is not None else None

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the request-build pool (a disk read, such as loading an adapter:
        neither the event loop nor the engine thread waits for it)."""
        return await asyncio.get_running_loop().run_in_executor(self._builders, fn, *args)

    # -- queries ------------------------------------------------------------------------
    async def cached_hashes(self) -> list[BlockHash]:
        return await self._call(lambda e: e.cached_hashes())

    async def stored_blocks(self) -> list[TierEvent]:
        """Every block held now, in every tier (LLMEngine.stored_blocks)."""
        return await self._call(lambda e: e.stored_blocks())

    async def leak_check(self) -> None:
        """AssertionError unless nothing is held (LLMEngine.leak_check)."""
        await self._call(lambda e: e.leak_check())

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread, its result or error returned: a connector's
        worker side reaching its own scheduler side (which lives on that thread), and
        tests."""
        return await self._call(fn)

    # -- plumbing -------------------------------------------------------------------------
    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        if self._dead is not None:
            raise EngineDead(f"the engine has stopped: {self._dead}")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in use on "
                                        "this worker")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def _close_if(self, request_id: str, q: asyncio.Queue) -> None:
        if self._streams.get(request_id) is q:
            del self._streams[request_id]

    async def _call(self, fn: Callable[[LLMEngine], Any], urgent: int | None = None) -> Any:
        """Run fn(engine) on the engine thread; return or raise its result. urgent: the
        priority of the request fn queues (a step of only less important requests is
        then cut short, LLMEngine.interrupt_for)."""
        if self._dead is not None:
            raise EngineDead(f"the engine has stopped: {self._dead}")
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        if urgent is not None and self._engine is not None:
            self._engine.interrupt_for(urgent)
        return await fut

    def _fire(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Queue fn without awaiting it (its outputs still reach their streams)."""
        if self._dead is None:
            fut = self._loop.create_future()
            fut.add_done_callback(self._deliver_result)
            self._commands.put((fn, fut))

    def _deliver_result(self, fut: asyncio.Future) -> None:
        """A fired call's outputs (an abort's: one per choice) reach their streams."""
        if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), list):
            self._deliver([o for o in fut.result() if isinstance(o, RequestOutput)])

    # -- engine thread ------------------------------------------------------------------------
    def _run(self, ready: asyncio.Future) -> None:
        try:
            engine = self._build()
            self._engine = engine
            self.kv_tensor = engine.kv_tensor
            self.info = engine.info()
            self.load = engine.load()
        except BaseException as e:  # noqa: BLE001 - report any build failure to start()
            self._loop.call_soon_threadsafe(_settle, ready, None, e)
            return
        self._loop.call_soon_threadsafe(_settle, ready, None, None)
        try:
            while not self._stopped.is_set():
                self._iterate(engine)
            engine.close()
        except BaseException as e:  # noqa: BLE001 - the engine thread is dying: say so
            log.critical("engine thread died", exc_info=True)
            self._dead = e
            self._loop.call_soon_threadsafe(self._die, e)

    def _iterate(self, engine: LLMEngine) -> None:
        engine.raise_if_broken()
        self._run_commands(engine, block=not engine.has_unfinished())
        if engine.has_unfinished():
            outs = engine.step()
            if outs:
                self._loop.call_soon_threadsafe(self._deliver, outs)
        events = engine.drain_kv_events()
        if events and self._on_events is not None:
            self._on_events(events)
        if self._on_step is not None:
            self._on_step(engine)
        load = engine.load()
        if load != self.load:
            self.load = load
            if self._on_load is not None:
                self._on_load(load)

    def _run_commands(self, engine: LLMEngine, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            try:
                result, error = fn(engine), None
            except Exception as e:  # noqa: BLE001 - the caller gets it
                result, error = None, e
            except BaseException as e:  # the thread dies of it (GroupFailed): its caller
                # was taken off the queue, so _die cannot reach it; settle it here
                self._dead = e  # dead from now: callers woken below must see it so
                dead = EngineDead(f"the engine thread died: {type(e).__name__}: {e}")
                self._loop.call_soon_threadsafe(_settle, fut, None, dead)
                raise
            self._loop.call_soon_threadsafe(_settle, fut, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    # -- event loop -----------------------------------------------------------------------------
    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _die(self, error: BaseException) -> None:
        """Engine thread gone: fail everything that waits on it."""
        dead = EngineDead(f"the engine thread died: {type(error).__name__}: {error}")
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _settle(item[1], None, dead)
        if self._engine is not None and self._engine.connector is not None:
            self._engine.connector.engine_stopped(dead)
        for rid, q in self._streams.items():
            q.put_nowait(RequestOutput(rid, [], "", True, FinishReason.ERROR, error=str(dead)))
        if self._on_death is not None:
            self._on_death(error)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
