"""Continuous batching with chunked prefill under a per-step token budget, in
priority order, with preemption by swap-to-host or recompute.

One step, in this order:
1. decodes: every running request whose prompt is done gets its next token,
   most important first (priority, then arrival); a request with proposed tokens
   (``Request.draft``, speculative decoding) gets slots for them too, as far as the
   budget and the free blocks allow. When the KV pool cannot grow,
   the least important running request is preempted (never a more important
   one while a less important runs);
2. swap-ins: preempted requests come back, most important first, when their
   blocks fit;
3. prefill work: the next chunk of running prompts and new admissions, merged in
   priority order, so a high-priority prompt runs between the chunks of a long
   low-priority one; a waiting request more important than a running one may
   preempt it to get in.
The scheduler only does bookkeeping: it lists the block copies (swap out, swap
in) that the runner performs before the forward pass.

Requests whose leading KV arrives from elsewhere (a KV connector says so,
engine/kv_connector.py) queue in ``waiting`` with the rest and are admitted in the
same priority order, taking a seat and their blocks but no compute budget. An
admitted one waits in ``loading`` (WAITING_FOR_KV) while its blocks are written, the
connector told where (``blocks_allocated``); loading requests are never preempted:
bytes may be landing in their blocks. Without a connector there are none.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.states import PreemptionMode
from engine.config import SchedulerConfig
from engine.kv_cache.manager import NULL_BLOCK, KVCacheManager
from engine.kv_cache.policy import kept_tokens
from engine.kv_cache.swap import SwapPool
from engine.kv_connector import ExternalKV, KVConnector
from engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: (request, new tokens), prefill-path entries first (speculating
    rows, which verify 1 + k tokens, count as decodes)."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[tuple[Request, PreemptionMode]] = field(default_factory=list)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(device blocks, host blocks) to copy device -> host before the forward."""
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(host blocks, device blocks) to copy host -> device before the forward."""

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass(frozen=True)
class PreemptionPolicy:
    mode: str = "auto"
    """swap | recompute | auto (swap unless the context is short or the swap pool full)."""
    recompute_below_tokens: int = 256
    """auto: contexts shorter than this are recomputed (cheaper than two copies)."""

    @property
    def forced(self) -> PreemptionMode | None:
        """The mode every preemption takes; None under auto."""
        return None if self.mode == "auto" else PreemptionMode(self.mode)


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig,
                 swap: SwapPool | None = None, connector: KVConnector | None = None,
                 max_loras: int = 0) -> None:
        """max_loras: distinct LoRA adapters the running batch may hold (0: no LoRA)."""
        self.priority_batch_cap = config.priority_batch_cap
        self.kv = kv
        self.swap = swap
        self.policy = PreemptionPolicy(config.preemption_mode)
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.connector = connector
        self.loading: dict[str, Request] = {}
        """Requests holding blocks while their leading KV is written (WAITING_FOR_KV)."""
        self._cap_turn = 0
        """Rotates which less important rows the priority cap lets through."""
        self.max_loras = max_loras
        self.lora_blocked = 0
        """Waiting or swapped requests kept back last step because their adapter would
        be one more than --max-loras (a gauge; the head of the queue waits for a slot)."""

    # -- queues ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.waiting.sort(key=Request.sort_key)

    def remove(self, req: Request) -> None:
        """Drop a request from whichever queue holds it and free its blocks."""
        for q in (self.waiting, self.running, self.swapped):
            if req in q:
                q.remove(req)
        self.loading.pop(req.request_id, None)
        self.kv.free(req)
        if self.swap is not None:
            self.swap.free(req.request_id)

    def has_work(self) -> bool:
        """Anything to compute or admit (loading requests wait for bytes, not steps)."""
        return bool(self.waiting or self.running or self.swapped)

    def activate(self, req: Request, loaded: bool) -> None:
        """A loading request's KV write ended: it joins the running batch. loaded=False
        is the recompute fallback (only the local prefix hit counts as computed)."""
        del self.loading[req.request_id]
        if loaded:
            req.num_computed_tokens = self._external(req).num_tokens
            self.kv.cache_computed(req)
        elif self.kv.first_held(req.request_id) * self.kv.block_size > req.num_computed_tokens:
            self.kv.free(req)  # only the window's blocks were allocated: recompute it all
            req.num_computed_tokens = 0
        self.connector.load_ended(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.running.sort(key=Request.sort_key)

    def join(self, req: Request) -> None:
        """A request that already holds its blocks (a forked choice, engine/fork.py)
        joins the running batch."""
        self._resume(req)

    @property
    def seats_taken(self) -> int:
        return len(self.running) + len(self.loading)

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.lora_blocked = 0
        self.running.sort(key=Request.sort_key)
        budget = self._decodes(batch, self.budget)
        if not batch.preempted:
            self._swap_ins(batch)
            self._prefills(batch, budget)
        # prefill path first, decodes last; a speculating row's 1 + k positions run as
        # 1 + k decode queries (ModelRunner.execute), so it goes with the decodes
        batch.entries.sort(key=lambda e: e[1] == 1 or bool(e[0].draft))
        return batch

    def _decodes(self, batch: ScheduledBatch, budget: int) -> int:
        # The best class decoding or about to be admitted: a step that admits an urgent
        # prompt is kept as short as one that decodes it (its TTFT, not just its TPOT).
        best = min((r.priority for r in self.running[:1] + self.waiting[:1]), default=0)
        allowed = self._capped_rows(best)
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue  # preempted earlier in this loop
            if len(req.token_ids) - req.num_computed_tokens != 1:
                continue  # still prefilling: step 3
            if allowed is not None and req.priority > best and req.request_id not in allowed:
                continue  # capped: protects the best class's inter-token latency
            if req.draft and not self._speculate(req, batch, budget):
                req.draft = []
            if req.draft:
                budget -= 1 + len(req.draft)
                continue
            while not self._allocate(req, 1):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.entries.append((req, 1))
                budget -= 1
        return budget

    def _speculate(self, req: Request, batch: ScheduledBatch, budget: int) -> bool:
        """Schedule a decode row with its proposed tokens (req.draft, trimmed to the
        budget): slots for all of them, never preempting for them (no room: False, the
        row decodes plainly). Verification commits only the accepted ones."""
        del req.draft[max(0, budget - 1):]
        if not req.draft or not self._allocate(req, 1 + len(req.draft)):
            return False
        batch.entries.append((req, 1 + len(req.draft)))
        return True

    def _capped_rows(self, best: int) -> set[str] | None:
        """The decode rows less important than ``best`` that may run this step (at most
        priority_batch_cap, taken in turn so every one advances); None: no cap."""
        if not self.priority_batch_cap:
            return None
        lower = [r for r in self.running
                 if r.priority > best and len(r.token_ids) - r.num_computed_tokens == 1]
        if len(lower) > self.priority_batch_cap:
            start = self._cap_turn % len(lower)
            self._cap_turn = start + self.priority_batch_cap
            lower = (lower + lower)[start:start + self.priority_batch_cap]
        return {r.request_id for r in lower}

    def _swap_ins(self, batch: ScheduledBatch) -> None:
        self.swapped.sort(key=Request.sort_key)
        while self.swapped and self.seats_taken < self.max_num_seqs:
            req = self.swapped[0]
            if self.waiting and self.waiting[0].sort_key() < req.sort_key():
                return  # a more important newcomer goes first
            if not self.lora_fits(req):
                return
            if not self._allocate(req, 0):
                return
            host = list(self.swap.free(req.request_id))
            batch.swap_in.append((host, self.kv.live_blocks(req, self._slides(req))))
            self.swapped.pop(0)
            self._resume(req)

    def _prefills(self, batch: ScheduledBatch, budget: int) -> None:
        todo = [r for r in self.running if len(r.token_ids) - r.num_computed_tokens > 1]
        todo += [r for r in self.waiting if r.status is RequestStatus.WAITING]
        for req in sorted(todo, key=Request.sort_key):
            if budget <= 0:
                return
            if req.status is RequestStatus.RUNNING:
                n = min(len(req.token_ids) - req.num_computed_tokens, budget)
                if n < len(req.token_ids) - req.num_computed_tokens and not self.chunked:
                    continue
                n = self.kv.chunk_limit(req, n)
                if not self._allocate_or_preempt(req, n, [], batch):
                    continue  # the blocks belong to more important requests, which will free them
                batch.entries.append((req, n))
                budget -= n
            elif req.status is not RequestStatus.WAITING:
                continue  # preempted earlier in this loop to seat a more important one
            elif self.kv.prefix_loading(req):
                continue  # its prefix is being read up from disk: it waits, the step goes on
            elif (ext := self._external(req)) is not None:
                if not self._admit_external(req, ext, batch):
                    return  # keep arrival order within the queue
            elif (n := self._admit(req, batch, budget)) is not None:
                budget -= n
            else:
                return  # keep arrival order within the queue: nothing overtakes a blocked head

    def _seat(self, req: Request, batch: ScheduledBatch, may_preempt: bool = True) -> bool:
        """A seat for req: a full batch gives up its least important seat to a more
        important request (else that request waits for a whole low-priority generation
        to end)."""
        if not self.lora_fits(req):
            return False
        seats = req.params.n if req.wants_fork else 1  # its choices run together
        if self.seats_taken + seats <= self.max_num_seqs:
            return True
        if not may_preempt or not self.running or self.running[-1].sort_key() <= req.sort_key():
            return False
        self._preempt(self.running[-1], batch)
        return True

    def lora_fits(self, req: Request) -> bool:
        """req's adapter is one the running batch holds, or a slot is left for it
        (``--max-loras`` distinct adapters run at once; the rest wait their turn)."""
        if req.lora is None:
            return True
        live = {r.lora.identity for r in (*self.running, *self.loading.values()) if r.lora}
        if req.lora.identity in live or len(live) < self.max_loras:
            return True
        self.lora_blocked += 1
        return False

    def _allocate_or_preempt(self, req: Request, n: int, cached: list[int],
                             batch: ScheduledBatch, may_preempt: bool = True) -> bool:
        """Blocks for n more tokens of req (an admission, or a running prompt's next
        chunk), preempting less important running requests while that helps; False (req
        untouched) when it still does not fit. A running prefill preempts too: two
        prompts mid-prefill whose KV together overflows the pool would otherwise each
        skip its chunk, step after step, and neither finish."""
        while not self._allocate(req, n, cached):
            victim = self.running[-1] if self.running else None
            if not may_preempt or victim is None or victim.sort_key() <= req.sort_key():
                return False
            self._preempt(victim, batch)
        return True

    def _slides(self, req: Request) -> bool:
        """Whether req's blocks before a sliding window are dropped: not when the connector
        takes its whole table once its prompt is done (another engine reads all of it).
        A bounded policy always drops: the other engine gets only the kept blocks."""
        return (self.connector is None or req.kv_policy is not None
                or not self.connector.ends_after_prompt(req))

    def _allocate(self, req: Request, n: int, cached: list[int] = ()) -> bool:
        return self.kv.allocate(req, n, cached, slide=self._slides(req))

    def _admit(self, req: Request, batch: ScheduledBatch, budget: int) -> int | None:
        if not self._seat(req, batch):
            return None
        # prompt logprobs still owed need their positions computed: no hit covers them
        cached = self.kv.find_cached_prefix(req, max_tokens=req.prompt_logprobs_owed)
        ncached = len(cached) * self.kv.block_size
        n = len(req.token_ids) - ncached
        if n > budget and not self.chunked:
            return None
        req.num_computed_tokens = ncached
        n = self.kv.chunk_limit(req, min(n, budget))
        if not self._allocate_or_preempt(req, n, cached, batch):
            req.num_computed_tokens = 0
            return None
        promoted = self.kv.claim_promoted(cached)
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(ncached, req.num_prompt_tokens)
            req.num_host_cached_tokens, req.num_disk_cached_tokens = promoted
        self.waiting.remove(req)
        self._resume(req)
        batch.entries.append((req, n))
        return n

    def _external(self, req: Request) -> ExternalKV | None:
        return self.connector.external_kv(req) if self.connector is not None else None

    def _admit_external(self, req: Request, ext: ExternalKV, batch: ScheduledBatch) -> bool:
        """Admit a request whose leading KV arrives from elsewhere: adopt its local prefix
        hit, allocate the rest of its context, park it in ``loading`` (no compute this
        step) and tell the connector where the bytes go."""
        if not self._seat(req, batch, ext.may_preempt):
            return False
        hit = self.kv.find_cached_prefix(req, max_tokens=ext.num_tokens)
        # allocated as of the first token computed here: with a sliding window, the blocks
        # wholly before its window are neither allocated nor loaded
        req.num_computed_tokens = ext.num_tokens
        need = len(req.token_ids) - ext.num_tokens
        if req.kv_policy is not None:
            # the table as the other engine's last query left it (a bounded policy's drops
            # re-rotate the kept keys, so its hole must be where that engine's was); the
            # next step here drops what the next query cannot see, as it would there
            req.num_computed_tokens, need = ext.num_tokens - 1, 1
        if not self._allocate_or_preempt(req, need, hit, batch, ext.may_preempt):
            req.num_computed_tokens = 0
            return False
        req.num_computed_tokens = req.num_cached_tokens = len(hit) * self.kv.block_size
        req.num_host_cached_tokens, req.num_disk_cached_tokens = self.kv.claim_promoted(hit)
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[req.request_id] = req
        table = self.kv.table(req.request_id)
        last = self.kv.blocks_needed(kept_tokens(req.kv_policy, ext.num_tokens))
        self.connector.blocks_allocated(req, req.num_computed_tokens, [
            (i, table[i]) for i in range(len(hit), last) if table[i] != NULL_BLOCK])
        return True

    def _resume(self, req: Request) -> None:
        if req.preempted_at is not None:
            req.preempted_seconds += time.monotonic() - req.preempted_at
            req.preempted_at = None
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.running.sort(key=Request.sort_key)

    # -- preemption ---------------------------------------------------------------------
    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        batch.entries = [(r, n) for r, n in batch.entries if r is not req]
        req.draft = []  # its guesses were for this step
        req.num_preemptions += 1
        req.preempted_at = time.monotonic()
        mode = self._mode(req)
        if mode is PreemptionMode.SWAP:
            live = self.kv.live_blocks(req, self._slides(req))
            host = self.swap.allocate(req.request_id, len(live))
            batch.swap_out.append((live, host))
            self.kv.free(req)
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.insert(0, req)
            self.waiting.sort(key=Request.sort_key)
        batch.preempted.append((req, mode))

    def _mode(self, req: Request) -> PreemptionMode:
        p, recompute = self.policy, PreemptionMode.RECOMPUTE
        if p.forced is recompute or self.swap is None or req.num_computed_tokens == 0:
            return recompute
        if p.forced is None and req.num_computed_tokens < p.recompute_below_tokens:
            return recompute
        if self.swap.num_free < len(self.kv.live_blocks(req, self._slides(req))):
            return recompute  # the swap pool is full: recompute is the fallback
        return PreemptionMode.SWAP
