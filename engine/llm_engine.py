"""The colocated engine: one process, no networking.

add_request / step / abort over the scheduler, the model runner and the output
processor. It is the reference the disaggregated path must match and the
``colocated`` baseline of the benchmarks. Not thread-safe: drive it from one
thread (the services run it on a dedicated engine thread).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from engine import remote
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner
from engine.models.llama import StepInterrupted
from engine.output import OutputProcessor
from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampling import SamplingParams
from engine.kv_cache.swap import SwapPool
from engine.scheduler import PreemptionPolicy, Scheduler
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineStats:
    """Cumulative counters the services export as metrics."""

    preemptions: dict[str, int] = field(default_factory=dict)
    """By mode: swap | recompute."""
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


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        if not config.model:
            raise ValueError("EngineConfig.model is empty: pass --model PATH "
                             "(tandem fetch-model puts the default model in the cache)")
        self.config = config
        ckpt = load_checkpoint(config.model)
        self.model_config = ckpt.config
        self.fingerprint = ckpt.fingerprint
        self.max_model_len = config.max_model_len or min(ckpt.config.max_position_embeddings,
                                                         DEFAULT_MAX_MODEL_LEN)
        self.tokenizer = tokenizer or (Tokenizer.from_gguf(ckpt.reader) if ckpt.reader is not None
                                       else Tokenizer.load(Path(config.model)))
        self.runner = ModelRunner(config, ckpt, self.max_model_len)
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"--kv-blocks {self.runner.num_blocks} holds {capacity} tokens, less than one "
                f"request of the context window (--max-model-len {self.max_model_len}); "
                f"raise --kv-blocks to at least {-(-self.max_model_len // config.block_size)} "
                "or lower --max-model-len")
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, config.hash_seed)
        self.swap = SwapPool(self.runner.num_swap_blocks) if self.runner.num_swap_blocks else None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.swap,
                                   PreemptionPolicy(config.preemption_mode),
                                   config.priority_batch_cap)
        self.stats = EngineStats()
        eos = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.held: dict[str, list[int]] = {}
        """Block tables of finished prefill_only requests, kept for a KV handoff."""
        self.num_computed_tokens_total = 0
        """Tokens run through the model since start (tests assert prefix-cache savings)."""
        self._urgent: int | None = None
        """Best priority of requests announced by interrupt_for since the step began."""

    # -- requests -------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams,
                     request_id: str | None = None, priority: int = 0,
                     output_token_ids: Sequence[int] = ()) -> Request:
        """Validate and build a Request without queueing it. Raises ValueError naming
        the field (prompt, request_id) when it cannot be served."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if len(ids) + len(output_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids) + len(output_token_ids)} tokens; the context "
                             f"window (max_model_len) is {self.max_model_len}, which leaves no "
                             "room for output")
        req = Request(request_id, ids, params, priority)
        if output_token_ids:  # resumed elsewhere: the outputs so far join the context
            req.token_ids.extend(output_token_ids)
            req.sampling.resume(output_token_ids, self.model_config.vocab_size,
                                self.runner.device)
        return req

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    output_token_ids: Sequence[int] = (), prefill_only: bool = False) -> str:
        req = self.make_request(prompt, params, request_id, priority, output_token_ids)
        req.prefill_only = prefill_only
        return self.admit(req)

    def admit(self, req: Request) -> str:
        """Queue a request built by make_request."""
        self.outputs.register(req)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; frees its blocks. Unknown ids are a no-op (None)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        return self.outputs.finish(req, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step loop ----------------------------------------------------------
    def interrupt_for(self, priority: int) -> None:
        """A request of this priority is about to be queued (any thread may call this).
        The step now running is abandoned between two layers when every request in it
        is less important, so the newcomer waits for one layer, not a whole step; the
        abandoned requests simply run again in the next step (nothing of theirs was
        committed). Off with --no-interrupt-steps."""
        if self.config.interrupt_steps and (self._urgent is None or priority < self._urgent):
            self._urgent = priority

    def step(self) -> list[RequestOutput]:
        self._urgent = None  # announced requests were queued before this step began
        batch = self.scheduler.schedule()
        self.apply_preemptions(batch)
        if not batch:
            return []
        tables = [self.kv.table(req.request_id) for req, _ in batch.entries]
        best = min(req.priority for req, _ in batch.entries)
        try:
            sampled, out = self.runner.execute(
                batch.entries, tables,
                lambda: self._urgent is not None and self._urgent < best)
        except StepInterrupted:
            self.stats.interrupted_steps += 1
            return []
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("engine step failed")
            return [self._finish(req, FinishReason.ERROR, error=f"engine step failed: {e}")
                    for req, _ in batch.entries]
        for req, n in batch.entries:
            req.num_computed_tokens += n
            self.num_computed_tokens_total += n
            self.kv.cache_computed(req)
        results: list[RequestOutput] = []
        for i, req in enumerate(sampled):
            result = self.outputs.append(req, out.token_ids[i], out.logprobs[i])
            if req.prefill_only and not result.finished:
                result.finished = True  # handed off: finish_reason stays None
                req.status = RequestStatus.FINISHED
                self.outputs.detok.pop(req.request_id, None)
            if result.finished:
                self._release(req)
            results.append(result)
        return results

    def apply_preemptions(self, batch) -> None:
        """Count a batch's preemptions and do its swap copies (before any forward)."""
        for _, mode in batch.preempted:
            self.stats.preemptions[mode] = self.stats.preemptions.get(mode, 0) + 1
        if batch.swap_out or batch.swap_in:
            t0 = time.perf_counter()
            self.runner.copy_blocks(batch.swap_out, batch.swap_in)
            bb = self.runner.block_bytes
            self.stats.swap_out_bytes += sum(len(d) for d, _ in batch.swap_out) * bb
            self.stats.swap_in_bytes += sum(len(d) for _, d in batch.swap_in) * bb
            self.stats.swap_seconds += time.perf_counter() - t0

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.scheduler.remove(req)
        return self.outputs.finish(req, reason, error)

    def _release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.stats.preempted_seconds += req.preempted_seconds
        if req.prefill_only and req.finish_reason is None:
            remote.hold(self, req)
        self.scheduler.remove(req)

    # -- disaggregation (see engine/remote.py) --------------------------------------
    def reserve_remote(self, req: Request, num_kv_tokens: int,
                       preempt_lower: bool = False) -> remote.RemoteReservation | None:
        return remote.reserve(self, req, num_kv_tokens, preempt_lower)

    def activate_remote(self, request_id: str, kv_arrived: bool) -> bool:
        return remote.activate(self, request_id, kv_arrived)

    def release_held(self, request_id: str) -> bool:
        return remote.release_held(self, request_id)

    # -- offline helper --------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run prompts to completion (batched) and return them in input order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        reqs = {i: self.requests[i] for i in ids}
        texts = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                texts[o.request_id].append(o.text)
        return [Completion(i, reqs[i].prompt_token_ids, reqs[i].output_token_ids,
                           "".join(texts[i]), reqs[i].finish_reason, reqs[i].num_cached_tokens)
                for i in ids]

    def leak_check(self) -> None:
        """AssertionError unless no request is held and every block is free."""
        if self.requests:
            raise AssertionError(f"requests still held: {sorted(self.requests)[:8]}")
        if self.held:
            raise AssertionError(f"prefill blocks still held for: {sorted(self.held)[:8]}")
        if self.swap is not None:
            self.swap.leak_check()
        self.kv.leak_check()
