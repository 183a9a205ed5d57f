"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests first (their next decode token, or the next chunk of
an unfinished prompt), in priority order; then waiting requests are admitted
while the budget, the sequence cap and the KV pool allow, reusing cached
prefix blocks. When a running request cannot get a block, the least important
running request (lowest priority, then latest arrival) is preempted by
recompute: its blocks are freed and it goes back to the front of the queue.
Policy for disaggregated workers lives in their services, not here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: (request, new tokens), prefill-path entries first."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.waiting.sort(key=Request.sort_key)

    def remove(self, req: Request) -> None:
        """Drop a request from whichever queue holds it and free its blocks."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.budget)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        batch.entries.sort(key=lambda e: e[1] == 1)  # prefill path first, decodes last
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        self.running.sort(key=Request.sort_key)
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue  # preempted earlier in this loop
            n = len(req.token_ids) - req.num_computed_tokens
            if n > budget and not self.chunked:
                continue
            n = min(n, budget)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.entries.append((req, n))
                budget -= n
        return budget

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        batch.entries = [(r, n) for r, n in batch.entries if r is not req]
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.insert(0, req)
        batch.preempted.append(req)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            ncached = len(cached) * self.kv.block_size
            n = len(req.token_ids) - ncached
            if n > budget and not self.chunked:
                break
            n = min(n, budget)
            req.num_computed_tokens = ncached
            if not self.kv.allocate(req, n, cached):
                req.num_computed_tokens = 0
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = min(ncached, req.num_prompt_tokens)
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.entries.append((req, n))
            budget -= n
