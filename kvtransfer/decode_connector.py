"""The decode side's KV connector (engine/kv_connector.py): admits a request whose
prompt KV is pulled from a prefill worker.

Scheduler side (engine thread): a request whose Request.kv_transfer is an
``ExternalKV`` (the KVHandle's token count; whether the router lets it preempt) is
admitted by the engine's scheduler in priority order with the rest, its own
prefix-cache hit adopted, preempting less important requests when allowed; once it
has its blocks, its ``RemoteReservation`` (where the missing blocks land) is recorded
in ``granted`` and the worker side is woken.

Worker side (event loop): ``reserve`` queues the request and waits for its
reservation; the caller then owns the pull and must end it with ``end_pull``
(kv_arrived True: the prompt's KV is here; False: it is recomputed here), or abort
it as owner once no pull is in flight. A reservation whose caller went away before
it came is given back at once (no pull was started). An Abort that arrives while the
pull writes is held by the engine until ``end_pull`` (WAITING_FOR_KV), so no byte
lands in a freed block.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from engine.engine_thread import EngineWorker
from engine.kv_connector import ExternalKV, KVConnector
from engine.llm_engine import LLMEngine
from engine.request import DuplicateRequestError, Request, RequestOutput


@dataclass(frozen=True)
class RemoteReservation:
    """Where a remote prompt's missing blocks must land in this engine's cache. Whoever
    receives one owns the pull: it must end it with ``end_pull`` (or abort as owner)."""

    request_id: str
    local_cached_tokens: int
    """Prompt tokens this engine already had (prefix cache hit)."""
    fill: list[tuple[int, int]]
    """(block index within the prompt, local block id) for every block to pull."""
    local_host_cached_tokens: int = 0
    local_disk_cached_tokens: int = 0
    """Of local_cached_tokens, those promoted from this engine's host and disk tiers."""


def remote_kv(req: Request, num_kv_tokens: int, preempt_lower: bool) -> ExternalKV:
    """The parameters of a request whose first num_kv_tokens tokens' KV a prefill worker
    holds; ValueError naming the field when they cannot be."""
    if not 0 < num_kv_tokens < len(req.token_ids):
        raise ValueError(f"kv_handle.num_tokens {num_kv_tokens} must be in [1, "
                         f"{len(req.token_ids)}) (the request's tokens)")
    return ExternalKV(num_kv_tokens, preempt_lower)


class DecodeConnector(KVConnector):
    def __init__(self, engine: EngineWorker | None = None) -> None:
        """``engine``: the driver the worker side runs through, on the running event
        loop. None: no worker side; the engine thread's caller takes the reservations
        with ``take_grants`` and ends them with LLMEngine.finish_loading (engine tests)."""
        self.engine = engine
        self._loop = asyncio.get_running_loop() if engine is not None else None
        self.granted: deque[RemoteReservation] = deque()
        """Reservations made on the engine thread, not yet handed out (appended there,
        taken on the event loop: deque's append and popleft are thread-safe)."""
        self._waiting: dict[str, asyncio.Future[RemoteReservation]] = {}
        """Event loop: callers of ``reserve`` waiting for their blocks, by request id."""

    # -- scheduler side (engine thread) ----------------------------------------------------
    def external_kv(self, req: Request) -> ExternalKV | None:
        return req.kv_transfer if isinstance(req.kv_transfer, ExternalKV) else None

    def load_ended(self, req: Request) -> None:
        req.kv_transfer = None  # its pull is over: recomputed here if preempted later

    def blocks_allocated(self, req: Request, num_local_tokens: int,
                         fill: list[tuple[int, int]]) -> None:
        # read here, on the engine thread, where the scheduler just set them
        self.granted.append(RemoteReservation(req.request_id, num_local_tokens, fill,
                                              req.num_host_cached_tokens,
                                              req.num_disk_cached_tokens))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._hand_out)

    def add_remote(self, engine: LLMEngine, req: Request, num_kv_tokens: int,
                   preempt_lower: bool = False) -> str:
        """Queue a remote admission from the engine thread (engine tests); its
        reservation then appears in ``take_grants``."""
        req.kv_transfer = remote_kv(req, num_kv_tokens, preempt_lower)
        return engine.admit(req)

    def take_grants(self) -> list[RemoteReservation]:
        """Reservations made since the last call; each must end with finish_loading."""
        out = []
        while self.granted:
            out.append(self.granted.popleft())
        return out

    def leak_check(self) -> None:
        if self.granted:
            raise AssertionError("reservations never handed out: "
                                 f"{sorted(r.request_id for r in self.granted)[:8]}")

    # -- worker side (event loop) ------------------------------------------------------------
    async def reserve(self, req: Request, num_kv_tokens: int, preempt_lower: bool
                      ) -> tuple[RemoteReservation, asyncio.Queue[RequestOutput]]:
        """Queue a remote admission and wait until the scheduler gives it blocks (in
        priority order, preempting when preempt_lower). The caller then owns the pull
        and must end it with ``end_pull`` (or ``EngineWorker.abort(owner=True)`` once
        no pull is in flight). Cancelled while waiting: the request is dropped here."""
        req.kv_transfer = remote_kv(req, num_kv_tokens, preempt_lower)
        rid = req.request_id
        if rid in self._waiting:  # its future is another caller's: never replace it
            raise DuplicateRequestError(f"request_id {rid!r} is already in use on this worker")
        fut: asyncio.Future[RemoteReservation] = self._loop.create_future()
        self._waiting[rid] = fut  # before admission: the blocks may come before add returns
        try:
            q = await self.engine.add(req)
        except BaseException:
            self._forget(rid, fut)
            raise
        try:
            return await fut, q
        except BaseException:
            self._forget(rid, fut)
            self.engine.close_stream(rid)
            self.engine.abort_soon(rid)  # admitted, and no pull was started
            raise

    async def end_pull(self, request_id: str, kv_arrived: bool) -> None:
        """The pull into a reserved request's blocks is over (LLMEngine.finish_loading)."""
        await self.engine.finish_loading(request_id, kv_arrived)

    def engine_stopped(self, error: BaseException) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)
        self._waiting.clear()

    def _hand_out(self) -> None:
        while self.granted:
            res = self.granted.popleft()
            fut = self._waiting.pop(res.request_id, None)
            if fut is None or fut.done():  # its caller went away before the grant: no pull
                self.engine.abort_soon(res.request_id)
            else:
                fut.set_result(res)

    def _forget(self, request_id: str, fut: asyncio.Future) -> None:
        if self._waiting.get(request_id) is fut:
            del self._waiting[request_id]
        if fut.done() and not fut.cancelled():
            fut.exception()  # engine_stopped's error reached the caller another way
