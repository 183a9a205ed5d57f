"""The KV connector contract: how KV computed elsewhere enters this engine, and how KV
computed here is kept for someone else to read.

An engine with no connector (``LLMEngine(connector=None)``) computes every request
from its first token and frees every finished request's blocks: the colocated
engine. A service that moves KV between engines plugs one in; the engine and its
scheduler then ask it the questions below and know nothing else of where KV goes.

Split by side, as vLLM v1 splits its KV connectors (``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``), much smaller:

Scheduler side (the methods of ``KVConnector``; called on the engine thread by the
scheduler and the engine, between steps or inside one; bookkeeping only, never
blocking, never touching bytes):
    bind               the engine's KV cache manager, once, before any request
    external_kv        how many leading tokens of a waiting request arrive from
                       elsewhere (None: it is computed here)
    blocks_allocated   a request's blocks are allocated and it waits for its KV
                       (``RequestStatus.WAITING_FOR_KV``): where the bytes must land
    ends_after_prompt  whether a request ends once its prompt is computed and its
                       first token sampled
    request_finished   whether a finished request's blocks are kept by the connector
                       rather than freed
    owns / free        a kept table's id is still live; free a kept table now (abort)
    num_kept, leak_check

Worker side (each implementation's own methods, on the event loop, talking to the
engine only through its driver, ``engine/engine_thread.py``): moves bytes, or hands
the destinations to whoever moves them, and reports the end of each load with
``LLMEngine.finish_loading``; ``engine_stopped`` is the one the driver calls.

The protocol of a load: a request for which ``external_kv`` answers is admitted in
priority order with the rest (taking a seat and its blocks, preempting less
important requests when ``ExternalKV.may_preempt``, no compute budget), then waits
in WAITING_FOR_KV, never preempted, while bytes may land in its blocks. Whoever
receives its ``blocks_allocated`` owns the load and must end it with
``LLMEngine.finish_loading`` (or ``LLMEngine.abort(owner=True)`` once no write is in
flight); an abort meanwhile is held until then, so no byte lands in a freed block.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheManager
    from engine.request import Request


@dataclass(frozen=True)
class ExternalKV:
    """A request whose leading KV arrives from elsewhere (``KVConnector.external_kv``)."""

    num_tokens: int
    """Leading tokens whose KV is loaded from elsewhere (or already cached here)."""
    may_preempt: bool = False
    """May preempt less important running requests to get its blocks."""


class KVConnector(abc.ABC):
    """A connector's scheduler side. Every method runs on the engine thread; none may
    block (record, or pass the work to the worker side and return)."""

    kv: KVCacheManager | None = None

    def bind(self, kv: KVCacheManager) -> None:
        """The engine's KV cache manager, given once by the engine before any request:
        tables the connector keeps (``request_finished``) are freed through it."""
        self.kv = kv

    # -- admission (Scheduler) -------------------------------------------------------
    def external_kv(self, req: Request) -> ExternalKV | None:
        """None: req is computed here from its first token. Otherwise its first
        ``num_tokens`` tokens' KV arrive from elsewhere: the scheduler admits it
        without compute, adopting this engine's own prefix-cache hit within them,
        and calls ``blocks_allocated``. Asked of every waiting request, each time it
        is considered for admission (a request preempted by recompute is asked again)."""
        return None

    def blocks_allocated(self, req: Request, num_local_tokens: int,
                         fill: list[tuple[int, int]]) -> None:
        """req has its blocks and waits (WAITING_FOR_KV). ``num_local_tokens``: leading
        tokens this engine already had (prefix cache); ``fill``: (block index within
        the request, local block id) for every block the external KV must land in.
        Whoever this is handed to owns the load (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} loads no external KV")

    def load_ended(self, req: Request) -> None:
        """req's external KV load is over (it runs here now, its KV arrived or to be
        recomputed). From here on req is this engine's own: a later admission (after a
        preemption by recompute dropped its KV) must compute it here, so
        ``external_kv`` answers None for it from now on."""

    # -- finishing (LLMEngine) ----------------------------------------------------------
    def ends_after_prompt(self, req: Request) -> bool:
        """True: req ends (finish_reason None) in the step that samples its first
        token, its prompt computed; ``request_finished`` then decides its blocks."""
        return False

    def request_finished(self, req: Request, table: list[int]) -> bool:
        """req finished in a step (not by an abort or an error). True: the connector
        takes ``table`` over, its block references with it (the engine frees nothing
        and forgets the table; the connector frees it with ``kv.release`` when its
        reader is done, or in ``free``). False: the engine frees the blocks."""
        return False

    def owns(self, request_id: str) -> bool:
        """A table kept under this id is still live (the id is in use here)."""
        return False

    def free(self, request_id: str) -> bool:
        """Free the table kept under request_id now (an abort), once. False when none
        is kept (never was, or already freed)."""
        return False

    @property
    def num_kept(self) -> int:
        """Tables kept now (the load snapshot reports them: drain waits for none)."""
        return 0

    def leak_check(self) -> None:
        """AssertionError unless the connector keeps nothing and owes nothing."""

    # -- worker side (event loop) ---------------------------------------------------------
    def engine_stopped(self, error: BaseException) -> None:
        """The engine thread died (event loop; the driver calls it): fail whatever
        waits on the engine through this connector with ``error``."""
