"""The engine: one process, no networking.

add_request / step / abort over the scheduler, the model runner and the output
processor. Without a KV connector (engine/kv_connector.py) it is the colocated
engine: the reference the disaggregated path must match and the ``colocated``
baseline of the benchmarks. A service that moves KV between engines plugs its
connector in; the engine asks it which requests' KV arrives from elsewhere and
which finished requests' blocks it keeps, and knows nothing more of it. Not
thread-safe: drive it from one thread (the services run it on a dedicated engine
thread, engine/engine_thread.py, through the public methods below).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.aborts import AbortMemory
from engine.fork import Choices, choice_of
from engine.config import CacheConfig, EngineConfig, dtype_name
from core.errors import FieldError
from core.states import PreemptionMode
from core.guided.compiler import GrammarCompiler
from core.errors import FieldError
from core.limits import check_priority, check_prompt
from core.kv import BlockHash, blocks_for, check_salt, lora_salt
from core.kv.policy import parse_kv_policy
from engine.kv_cache import KVCacheManager
from engine.kv_connector import KVConnector
from engine.lora.registry import open_registry
from engine.parallel.runner import make_runner
from engine.models.base import StepInterrupted
from engine.output import OutputProcessor
from engine.parallel.group import TPGroup
from engine.request import (DuplicateRequestError, FinishReason, Request, RequestOutput,
                            RequestStatus)
from core.sampling import SamplingParams
from engine.kv_cache.policy import check_scores, request_policy
from engine.kv_cache.swap import HostSlots, SwapPool
from engine.kv_cache.tiers import build_tiers
from engine.kv_cache.tiers.events import TierEvent, device_blocks, device_events
from engine.scheduler import Scheduler
from engine.served_model import (checkpoint_tokenizer, context_window, open_checkpoint,
                                 served_fingerprint)
from engine.spec.speculator import Speculator
from engine.status import EngineInfo, EngineLoad
from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Cumulative counters the services export as metrics."""

    preemptions: dict[PreemptionMode, int] = field(default_factory=dict)
    """By mode."""
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_seconds: float = 0.0
    preempted_seconds: float = 0.0
    """Summed over finished requests: time spent preempted."""
    interrupted_steps: int = 0
    """Steps abandoned mid-forward for a more important arrival (interrupt_for)."""


@dataclass
class Completion:
    """A finished request, as returned by LLMEngine.generate."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    cached_by_tier: tuple[int, int] = (0, 0)
    """Of num_cached_tokens, those promoted from the host tier and from the disk tier."""


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 connector: KVConnector | None = None, tp_group: TPGroup | None = None) -> None:
        """tp_group: at --tensor-parallel-size > 1, a group of that size to run on (tests
        share one across engines); None starts the engine's own."""
        self.config = config
        ckpt = open_checkpoint(config.load)
        self.model_config = ckpt.config
        self.fingerprint = served_fingerprint(ckpt, config.quant)
        self.max_model_len = context_window(config.load, ckpt.config)
        self.tokenizer = tokenizer or checkpoint_tokenizer(ckpt)
        self.runner = make_runner(config, ckpt, self.max_model_len, tp_group)
        self.kv_policy = parse_kv_policy(config.cache.kv_policy, "--kv-policy")
        """The server's KV policy (None: full); a request may name another only under
        --allow-request-kv-policy (engine/kv_cache/policy.py request_policy)."""
        if self.kv_policy is not None:
            self.kv_policy.check(config.cache.block_size, self.max_model_len, "--kv-policy")
            if self.kv_policy.scored:
                check_scores(self.runner, "--kv-policy")
        self.kv = self._kv_cache(config.cache, colocated=connector is None)
        self.kv.on_shift = self.runner.shift_keys
        slots = HostSlots(self.runner.num_host_slots)
        self.swap = SwapPool(self.runner.num_swap_blocks, slots) if self.runner.num_swap_blocks else None
        self.tiers = build_tiers(config.cache, self.kv, self.runner.kv,
                                 slots, self.fingerprint, self.runner.kv_dtype,
                                 self.runner.copy_blocks, self.runner,
                                 self.model_config.num_kv_heads)
        """Host and disk tiers below the device pool (--kv-offload-*); None: off."""
        self.connector = connector
        """Where KV comes from and goes to besides this engine; None: colocated."""
        if connector is not None:
            connector.bind(self.kv)
        self.loras = open_registry(config.lora, self.runner)
        """The LoRA adapters served by name (engine/lora/registry.py); None: base only."""
        self.scheduler = Scheduler(self.kv, config.scheduler, self.swap, connector=connector,
                                   max_loras=config.lora.max_loras if self.loras else 0)
        self.stats = EngineStats()
        self.speculator = Speculator.create(config.spec, self.runner, self.tokenizer,
                                            self.max_model_len)
        if self.speculator is not None:
            self.speculator.proposer.bind(self.kv.tables)
        eos = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        """The model's end tokens (masked until a request's min_tokens)."""
        self.guided = GrammarCompiler(self.tokenizer, ckpt.config.vocab_size, sorted(eos))
        """Constraints compiled once each, checked before a request is queued."""
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len, self.guided)
        self.requests: dict[str, Request] = {}
        self.choices = Choices()
        """Forked requests' choices (n > 1), by the request's id."""
        self.aborts = AbortMemory()
        """Aborts of ids not (yet) here: their requests are refused when they arrive."""
        self.num_computed_tokens_total = 0
        """Tokens run through the model since start (tests assert prefix-cache savings)."""
        self._urgent: int | None = None
        """Best priority of requests announced by interrupt_for since the step began."""

    def _kv_cache(self, cache: CacheConfig, colocated: bool) -> KVCacheManager:
        """The block manager over the runner's pool; ValueError when the pool cannot hold
        one request of the context window: all of it, or, colocated with chunked prefill
        and a sliding window, one chunk and the window before it (what a request then
        holds at most; a P/D worker keeps or reads whole prompts), or, where every request
        runs under the bounded --kv-policy, its budget."""
        window, sched = self._kv_window(), self.config.scheduler
        tokens = self.max_model_len
        if window is not None and colocated and sched.enable_chunked_prefill:
            tokens = min(tokens, window - 1 + sched.max_num_batched_tokens + cache.block_size)
        if self.kv_policy is not None and not cache.allow_request_kv_policy:
            tokens = self.kv_policy.budget_blocks(cache.block_size) * cache.block_size
        capacity = self.runner.num_blocks * cache.block_size
        if capacity < tokens:
            raise ValueError(
                f"--kv-blocks {self.runner.num_blocks} holds {capacity} tokens, less than one "
                f"request of the context window (--max-model-len {self.max_model_len}); "
                f"raise --kv-blocks to at least {blocks_for(tokens, cache.block_size)} "
                "or lower --max-model-len")
        return KVCacheManager(self.runner.num_blocks, cache.block_size,
                              cache.enable_prefix_caching, cache.hash_seed,
                              sliding_window=window)

    def _kv_window(self) -> int | None:
        """The window KV memory follows: the widest of the layers' windows when every
        layer slides (read from the model's own LayerAttention, so a family that mixes
        sliding and global layers, Gemma 2/3 or Qwen2's max_window_layers, keeps every
        block), unless a separate draft model shares the block tables (it may attend
        further back, so every block is kept)."""
        windows = [p.window for p in self.runner.model.attention_params()]
        window = None if None in windows else max(windows)
        spec = self.config.spec
        if spec.speculative_method == "draft" and not spec.speculative_model.startswith("self:"):
            return None
        return window

    # -- requests -------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams,
                     request_id: str | None = None, priority: int = 0,
                     output_token_ids: Sequence[int] = (), cache_salt: bytes = b"",
                     lora: str = "", kv_policy: str | None = None) -> Request:
        """Validate and build a Request without queueing it. Raises ValueError naming
        the field (prompt, output_token_ids, guided, max_tokens, cache_salt, model) when it
        cannot be served. ``cache_salt`` keeps its prefix-cache blocks apart from other
        salts' (Request.cache_salt); ``lora`` names the adapter it runs under ("": the
        base model), whose identity is folded into that salt. ``kv_policy``: the
        request's own KV policy (text, core/kv/policy.py; None: the server's). Reads only
        the engine's fixed configuration (and the thread-safe grammar
        cache), so any thread may call it; whether the id is free is decided when the
        request is admitted (``admit``), on the engine thread."""
        request_id = request_id or uuid.uuid4().hex
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        cache = self.config.cache
        policy = request_policy(kv_policy, self.kv_policy, cache.allow_request_kv_policy,
                                cache.block_size, self.max_model_len)
        if policy is None:
            check_prompt(ids, self.model_config.vocab_size, self.max_model_len, output_token_ids)
        else:
            check_prompt(ids, self.model_config.vocab_size, cache.max_stream_len,
                         output_token_ids, limit="a bounded kv_policy's length (--max-stream-len)")
        check_priority(priority)
        params.check_vocab(self.model_config.vocab_size)
        if params.n > self.config.scheduler.max_num_seqs:
            raise FieldError("n", f"n: {params.n} choices cannot run together on a worker of "
                                  f"--max-num-seqs {self.config.scheduler.max_num_seqs}")
        if policy is not None and policy.scored:
            check_scores(self.runner, "kv_policy")
        if params.n > 1 and policy is not None:  # forks share blocks a bounded policy re-rotates
            raise FieldError("n", "n: several choices need kv_policy full (a bounded policy "
                                  "re-rotates its keys in place, so its blocks cannot be shared)")
        req = Request(request_id, ids, params, priority, cache_salt=check_salt(cache_salt),
                      kv_policy=policy, max_total_len=policy and cache.max_stream_len)
        if lora:
            req.lora = self.lora_adapter(lora)
            req.cache_salt = lora_salt(req.cache_salt, req.lora.identity)
        req.sampling.eos_token_ids = self.eos_token_ids
        if params.guided is not None:  # the grammar compiles and can finish, or no work
            if not output_token_ids:
                self.guided.check(params.guided, params.max_tokens)
            req.sampling.guide = self.guided.start(params.guided)
        if output_token_ids:  # resumed elsewhere: the outputs so far join the context
            req.token_ids.extend(output_token_ids)
            req.sampling.resume(output_token_ids, self.model_config.vocab_size,
                                self.runner.device)
        return req

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    output_token_ids: Sequence[int] = (), kv_transfer: object | None = None,
                    cache_salt: bytes = b"", lora: str = "",
                    kv_policy: str | None = None) -> str:
        """make_request and admit; ``kv_transfer``: the connector's parameters for it
        (Request.kv_transfer)."""
        req = self.make_request(prompt, params, request_id, priority, output_token_ids,
                                cache_salt, lora, kv_policy)
        req.kv_transfer = kv_transfer
        return self.admit(req)

    def lora_adapter(self, name: str):
        """The adapter served as ``name`` (FieldError naming model when there is none)."""
        if self.loras is None:
            raise FieldError("model", f"model: {name!r} names a LoRA adapter, and this "
                                      f"server runs without LoRA (--enable-lora)")
        return self.loras.get(name)

    def admit(self, req: Request) -> str:
        """Queue a request built by make_request. DuplicateRequestError when its id is
        live here (``has_request``)."""
        rid = req.request_id
        if self.has_request(rid):
            raise DuplicateRequestError(f"request_id {rid!r} is already in use on this worker")
        self.aborts.check_admission(rid)
        self.outputs.register(req)
        self.requests[rid] = req
        self.scheduler.add(req)
        req.admitted = True
        return rid

    def abort_if_admitted(self, req: Request) -> list[RequestOutput]:
        """abort_request(owner=True) of this very request, if it was admitted: a caller
        that went away before learning whether its admission ran (a refused duplicate
        must not abort the live request that owns the id)."""
        return self.abort_request(req.request_id, owner=True) if req.admitted else []

    def has_request(self, request_id: str) -> bool:
        """The id is live here: queued, running, loading, or its blocks kept by the
        connector."""
        return request_id in self.requests or request_id in self.choices or (
            self.connector is not None and self.connector.owns(request_id))

    def abort(self, request_id: str, owner: bool = False) -> RequestOutput | None:
        """abort_request, returning the first choice's output (the only one with n = 1)."""
        outs = self.abort_request(request_id, owner)
        return outs[0] if outs else None

    def abort_request(self, request_id: str, owner: bool = False) -> list[RequestOutput]:
        """Cancel a request, every choice of it (n > 1), and free their blocks, those the
        connector keeps included; one output per choice ended. Unknown ids are a no-op
        (none). A request whose leading KV is being written (WAITING_FOR_KV) only
        finishes when the write ends (``finish_loading``), unless the caller owns the
        load and says no write is in flight (owner=True)."""
        freed = self.connector is not None and self.connector.free(request_id)
        req = self.requests.get(request_id)
        members = self.choices.live(request_id) or ([req] if req is not None else [])
        if not members:
            if not freed:  # it may still be on its way here: refused when it comes
                self.aborts.aborted_unknown(request_id)
            return []
        if req is not None and req.status is RequestStatus.WAITING_FOR_KV and not owner:
            req.abort_pending = True
            return []
        return [self._finish(r, FinishReason.ABORT) for r in members]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step loop ----------------------------------------------------------
    def interrupt_for(self, priority: int) -> None:
        """A request of this priority is about to be queued (any thread may call this).
        The step now running is abandoned between two layers when every request in it
        is less important, so the newcomer waits for one layer, not a whole step; the
        abandoned requests simply run again in the next step (nothing of theirs was
        committed). Off with --no-interrupt-steps."""
        if self.config.scheduler.interrupt_steps and (self._urgent is None or priority < self._urgent):
            self._urgent = priority

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass. A failure anywhere in it fails
        the requests it touched (every request, when scheduling itself failed) with an
        error output; the engine goes on serving the rest."""
        self._urgent = None  # announced requests were queued before this step began
        try:
            if self.speculator is not None:
                self.speculator.prepare(self.scheduler.running, self._ends_after_prompt)
            batch = self.scheduler.schedule()
            self.apply_preemptions(batch)
        except Exception as e:  # noqa: BLE001 - the barrier: fail requests, not the engine
            log.exception("engine scheduling failed")
            self.kv.take_copies()  # for blocks now freed
            self._settle_host_copies()
            return self.fail_all(f"engine scheduling failed: {e}")
        if not batch:
            if self.tiers is not None:  # nothing runs until a prefix's disk read lands
                self.tiers.wait_for_loads(0.01)
            return []
        results: list[RequestOutput] = []
        try:
            self._run_batch(batch, results)
        except StepInterrupted:
            self.stats.interrupted_steps += 1
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests
            log.exception("engine step failed")
            results += [self._finish(req, FinishReason.ERROR, error=f"engine step failed: {e}")
                        for req, _ in batch.entries if req.request_id in self.requests]
        return results

    def _run_batch(self, batch, results: list[RequestOutput]) -> None:
        """(Draft,) forward, commit, sample; appends each output to results as it is made."""
        if self.speculator is not None:
            batch.entries = self.speculator.fill(batch.entries)
        tables = [self.kv.table(req.request_id) for req, _ in batch.entries]
        best = min(req.priority for req, _ in batch.entries)
        forking = self._choices_due(batch.entries)
        try:
            step = self.runner.execute(
                batch.entries, tables, lambda: self._urgent is not None and self._urgent < best)
        finally:  # sampled with their parent this step, or not at all (interrupted)
            forks = {id(p): p.forks for p in forking}
            for parent in forking:
                parent.forks = []
        for req, lps in step.prompt_logprobs:
            req.prompt_logprobs.extend(lps)
        for req, n in batch.entries:
            self.num_computed_tokens_total += n
            if not req.draft:
                req.num_computed_tokens += n
                self.kv.cache_computed(req)
            if req.wants_fork and req.num_output_tokens and \
                    req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork(req, [choice_of(req, j, self.guided.start)
                                 for j in range(1, req.params.n)], req.num_prompt_tokens - 1)
        for parent in forking:
            self._fork(parent, forks[id(parent)], parent.num_prompt_tokens)
        ended = [(req, None, None) for req, _ in batch.entries
                 if req.num_computed_tokens == len(req.token_ids) and not req.may_generate]
        for req, tokens, logprobs in [*zip(step.requests, step.tokens, step.logprobs), *ended]:
            if tokens is None:  # max_tokens 0: its prompt is all it ran
                result = self.outputs.prompt_done(req)
            elif req.draft:
                result = self._commit_verified(req, tokens, logprobs)
            else:
                result = self.outputs.append(req, tokens[0], logprobs[0])
            if not result.finished and self._ends_after_prompt(req):
                result.finished = True  # its KV goes on elsewhere: finish_reason stays None
                req.status = RequestStatus.FINISHED
                self.outputs.forget(req.request_id)
            if result.finished:
                result.kept_blocks = self._release(req)
                _summarize(result, req)
            results.append(result)

    def _choices_due(self, entries: list[tuple[Request, int]]) -> list[Request]:
        """The requests (n > 1) whose prompt ends in this step: their other choices,
        built now into Request.forks, are sampled from the same logits row."""
        due = []
        for req, n in entries:
            if req.wants_fork and not req.num_output_tokens and not req.draft \
                    and req.num_computed_tokens + n == len(req.token_ids) \
                    and not self._ends_after_prompt(req):
                req.forks = [choice_of(req, j, self.guided.start) for j in range(1, req.params.n)]
                due.append(req)
        return due

    def _fork(self, parent: Request, children: list[Request], num_computed: int) -> None:
        """Queue parent's other choices, running, on its blocks (engine/fork.py), each
        with its first ``num_computed`` tokens computed."""
        parent.forked = True
        for child in children:
            child.num_computed_tokens = num_computed
            self.kv.fork(parent, child, parent.num_prompt_tokens)
            self.outputs.register(child)
            self.requests[child.request_id] = child
            child.admitted = True
            self.scheduler.join(child)
        self.choices.add(parent, children)

    def _ends_after_prompt(self, req: Request) -> bool:
        return self.connector is not None and self.connector.ends_after_prompt(req)

    def _commit_verified(self, req: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        """A speculating row: commit the emitted tokens up to the first that finishes the
        request. Every kept token but the last now has its K/V computed (the verify pass
        wrote them); slots past that had rejected guesses: blocks beyond the context are
        returned, and only computed (accepted) tokens ever reach the prefix cache."""
        result = self.outputs.append_many(req, tokens, logprobs)
        kept = len(result.new_token_ids)
        req.num_computed_tokens += kept
        self.kv.cache_computed(req)
        self.kv.trim(req, len(req.token_ids))
        self.speculator.record(req, len(tokens), kept)
        req.draft = []
        return result

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with an error (its blocks freed), except those whose KV
        is being written (WAITING_FOR_KV): they finish when the write ends. What a failed
        scheduling step leaves behind cannot be trusted, so nothing of it is kept."""
        outs = []
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING_FOR_KV:
                req.abort_pending = True
            else:
                outs.append(self._finish(req, FinishReason.ERROR, error=error))
        return outs

    def apply_preemptions(self, batch) -> None:
        """Count a batch's preemptions and do its swap copies (before any forward)."""
        for _, mode in batch.preempted:
            self.stats.preemptions[mode] = self.stats.preemptions.get(mode, 0) + 1
        copies = self.kv.take_copies()  # copy-on-write of blocks that forks share
        if batch.swap_out or batch.swap_in or copies:
            t0 = time.perf_counter()
            self.runner.copy_blocks(batch.swap_out, batch.swap_in, copies, self._draft_kv())
            bb = self.runner.block_bytes
            self.stats.swap_out_bytes += sum(len(d) for d, _ in batch.swap_out) * bb
            self.stats.swap_in_bytes += sum(len(d) for _, d in batch.swap_in) * bb
            self.stats.swap_seconds += time.perf_counter() - t0
        self._settle_host_copies()

    def _draft_kv(self):
        """A separate draft model's cache (the same block ids), which copy-on-write
        copies too; None without one."""
        kv = getattr(self.speculator.proposer, "kv", None) if self.speculator else None
        return kv if kv is not None and kv is not self.runner.kv else None

    def _settle_host_copies(self) -> None:
        """After the step's swap copies: the tiers' promotions copy (a swap-out has read
        the blocks they may write) and the host slots freed this step are reusable."""
        if self.tiers is not None:
            self.tiers.flush()
        if self.swap is not None:
            self.swap.slots.settle()

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.aborts.ended(req.request_id)
        self.scheduler.remove(req)
        out = self.outputs.finish(req, reason, error)
        self.choices.ended(req)
        return _summarize(out, req)

    def _release(self, req: Request) -> list[int] | None:
        """A request finished in a step: free it, or, when the connector keeps its block
        table (KVConnector.request_finished), hand the table over and return its ids."""
        rid = req.request_id
        self.requests.pop(rid, None)
        self.aborts.ended(rid)
        self.stats.preempted_seconds += req.preempted_seconds
        ids = None
        table = self.kv.tables.get(rid)
        if self.connector is not None and table is not None \
                and self.connector.request_finished(req, table):
            ids = list(self.kv.detach(rid))  # refs kept: now the connector's
        self.scheduler.remove(req)
        self.choices.ended(req)
        return ids

    # -- loads (a connector's worker side, through the engine thread) ---------------------
    def finish_loading(self, request_id: str, loaded: bool) -> RequestOutput | None:
        """A loading request's KV write ended (its owner says so: KVConnector). It joins
        the running batch (loaded=False: the prompt is recomputed here), or, when an
        abort came meanwhile, finishes now (its output is returned). None also for
        unknown ids."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            return None
        if req.abort_pending:
            return self._finish(req, FinishReason.ABORT)
        self.scheduler.activate(req, loaded)
        if loaded and req.wants_fork:  # its KV arrived: its other choices fork now
            self._fork(req, [choice_of(req, j, self.guided.start) for j in range(1, req.params.n)],
                       req.num_prompt_tokens - 1)
        return None

    # -- what the engine thread's driver reads -----------------------------------------
    def info(self) -> EngineInfo:
        """The facts fixed when the engine was built."""
        r = self.runner
        return EngineInfo(self.model_config, self.fingerprint, self.config.cache.block_size,
                          self.kv.pool.num_blocks, self.max_model_len, r.block_bytes,
                          r.kv_dtype, dtype_name(r.dtype))

    def load(self) -> EngineLoad:
        """A snapshot of what is queued, running, loading and kept here."""
        sched, pool = self.scheduler, self.kv.pool
        return EngineLoad(
            num_waiting=len(sched.waiting) + len(sched.swapped), num_running=len(sched.running),
            num_loading=len(sched.loading),
            num_kept=self.connector.num_kept if self.connector is not None else 0,
            free_blocks=pool.num_free, total_blocks=pool.num_blocks,
            queued_prompt_tokens=sum(len(r.token_ids) - r.num_computed_tokens
                                     for r in sched.waiting),
            swap_used_blocks=(self.swap.num_blocks - self.swap.num_free) if self.swap else 0)

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The paged KV tensor (a KV transfer backend registers it)."""
        return self.runner.kv

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache now."""
        return list(self.kv.pool.cached)

    def drain_kv_events(self) -> list[TierEvent]:
        """The prefix cache's changes since the last call, in every tier (the device
        pool's first, with their tokens; then the host and disk tiers')."""
        events = device_events(self.kv.pool, self.kv.pool.drain_events())
        return events + (self.tiers.drain_events() if self.tiers is not None else [])

    def stored_blocks(self) -> list[TierEvent]:
        """Every block stored now, in every tier, as stores (a subscriber's snapshot;
        the events drained after it are the changes)."""
        blocks = device_blocks(self.kv.pool)
        return blocks + (self.tiers.stored() if self.tiers is not None else [])

    # -- offline helper --------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 loras: Sequence[str] | None = None) -> list[Completion]:
        """Run prompts to completion (batched) and return them in input order; loras:
        each prompt's adapter name ("" or None: the base model)."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        names = list(loras) if loras is not None else [""] * len(prompts)
        ids = [self.add_request(p, sp, lora=name or "")
               for p, sp, name in zip(prompts, plist, names)]
        reqs = {i: self.requests[i] for i in ids}
        texts = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.index == 0:  # the first choice (n > 1: read the step outputs)
                    texts[o.request_id].append(o.text)
        return [Completion(i, reqs[i].prompt_token_ids, reqs[i].output_token_ids,
                           "".join(texts[i]), reqs[i].finish_reason, reqs[i].num_cached_tokens,
                           (reqs[i].num_host_cached_tokens, reqs[i].num_disk_cached_tokens))
                for i in ids]

    def close(self) -> None:
        """At shutdown: what outlives the engine's steps ends cleanly (the disk tier's
        queued blocks are written, so a restart finds them; a tensor-parallel group's
        other ranks end)."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.close()

    def raise_if_broken(self) -> None:
        """Raise (GroupFailed, engine/parallel/group.py) once no step can run any more:
        the engine thread asks between steps, so a lost rank stops an idle engine too."""
        self.runner.raise_if_broken()

    def leak_check(self) -> None:
        """AssertionError unless no request is left and every block is free."""
        if self.requests or self.choices:
            raise AssertionError(f"requests still live: {sorted(self.requests)[:8]}, "
                                 f"{len(self.choices)} forked")
        if self.scheduler.loading:
            raise AssertionError(f"requests still loading: {sorted(self.scheduler.loading)[:8]}")
        if self.connector is not None:
            self.connector.leak_check()
        if self.swap is not None:
            self.swap.leak_check()
        if self.tiers is not None:
            self.tiers.leak_check(self.swap.num_used if self.swap else 0)
        self.kv.leak_check()


def _summarize(out: RequestOutput, req: Request) -> RequestOutput:
    """A request's last output says what its whole life was: its speculation totals and
    its preemptions."""
    out.spec = req.spec.summary() if req.spec is not None else None
    out.num_preemptions, out.preempted_seconds = req.num_preemptions, req.preempted_seconds
    return out
