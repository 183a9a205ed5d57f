"""Disaggregation hooks of the engine: hold a prefill's blocks for handoff, and
admit a request whose prompt KV arrives from another worker.

Kept apart from llm_engine.py so the colocated step loop reads on its own; every
function here runs on the engine thread like the rest of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class RemoteReservation:
    """Where a remote prompt's missing blocks must land in this engine's cache."""

    request_id: str
    local_cached_tokens: int
    """Prompt tokens this engine already had (prefix cache hit)."""
    fill: list[tuple[int, int]]
    """(block index within the prompt, local block id) for every block to pull."""


def reserve(engine: LLMEngine, req: Request, num_kv_tokens: int,
            preempt_lower: bool = False) -> RemoteReservation | None:
    """Allocate blocks for req (its prefix-cache hit adopted, the rest new) and park
    it as WAITING_FOR_KV. None, with nothing allocated, when the pool is too full.
    preempt_lower: make room by preempting less important running requests."""
    kv = engine.kv
    hit = kv.find_cached_prefix(req, max_tokens=num_kv_tokens)
    req.num_computed_tokens = len(hit) * kv.block_size
    need = len(req.token_ids) - req.num_computed_tokens
    if preempt_lower and not kv.can_allocate(req, need, hit):
        blocks = kv.blocks_needed(len(req.token_ids)) - len(hit)
        engine.apply_preemptions(engine.scheduler.preempt_for(req, blocks))
    if not kv.allocate(req, need, hit):
        req.num_computed_tokens = 0
        return None
    req.num_kv_tokens = num_kv_tokens
    req.num_cached_tokens = req.num_computed_tokens
    req.status = RequestStatus.WAITING_FOR_KV
    engine.outputs.register(req)
    engine.requests[req.request_id] = req
    table = kv.table(req.request_id)
    first, last = len(hit), kv.blocks_needed(num_kv_tokens)
    return RemoteReservation(req.request_id, req.num_computed_tokens,
                             [(i, table[i]) for i in range(first, last)])


def activate(engine: LLMEngine, request_id: str, kv_arrived: bool) -> bool:
    """Join a WAITING_FOR_KV request to the running batch. kv_arrived=False is the
    recompute fallback: only the local prefix hit counts as computed. False when the
    request is gone (aborted meanwhile)."""
    req = engine.requests.get(request_id)
    if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
        return False
    if kv_arrived:
        req.num_computed_tokens = req.num_kv_tokens
        engine.kv.cache_computed(req)
    req.status = RequestStatus.RUNNING
    engine.scheduler.running.append(req)
    return True


def hold(engine: LLMEngine, req: Request) -> None:
    """Move a finished prefill's block table into engine.held (refs kept). A table
    still held under the same id (an earlier attempt of a retried request) is freed."""
    release_held(engine, req.request_id)
    engine.held[req.request_id] = engine.kv.tables.pop(req.request_id)
    engine.kv._num_cached.pop(req.request_id, None)


def release_held(engine: LLMEngine, request_id: str) -> bool:
    """Free a held table once; False for unknown or already released ids."""
    table: Sequence[int] | None = engine.held.pop(request_id, None)
    if table is None:
        return False
    engine.kv.pool.free(list(reversed(table)))
    return True
