"""One request's life through the cluster, as the router drives it.

1. hash the prompt's full blocks; pick a decode worker (prefix overlap vs load);
2. if the uncached part is short, the decode worker prefills it itself
   (conditional disaggregation); else pick a prefill worker, get the first token
   and a KVHandle, and stream that token to the client at once;
3. stream the decode worker's tokens; detokenize and apply stop strings here,
   where the client's text is produced.
If the client goes away, the request is aborted on every worker it touched.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine.kv_cache import hash_token_blocks
from engine.sampling import SamplingParams, StopStringMatcher
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from proto import common_pb2 as common
from proto import decode_pb2, prefill_pb2
from router.config import RouterConfig
from router.placement import Placer
from router.workers import Worker, WorkerPool
from worker.convert import sampling_to_proto, top_from_proto

log = logging.getLogger(__name__)


MAX_ATTEMPTS = 3
# A worker that died or stopped answering; another can take the request over.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.ABORTED}


class NoWorkerError(RuntimeError):
    """No healthy worker of a needed role (HTTP 503)."""


class WorkerError(RuntimeError):
    """A worker refused the request (its gRPC status maps to an HTTP code)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


Logprob = tuple[float, list[tuple[int, float]]]
"""A generated token's logprob and its top-N alternatives [(token id, logprob)]."""


@dataclass
class Delta:
    """What the client sees next: new text (and tokens), and the end."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    """One per token id, when logprobs were requested."""


@dataclass
class Trace:
    request_id: str
    path: str = ""
    """disaggregated | local_prefill"""
    prefill_worker: str = ""
    decode_worker: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    predicted_cached_tokens: int = 0
    """Prompt tokens the chosen worker's KV events said it held (the one that prefills)."""
    realized_cached_tokens: int = 0
    """Prompt tokens that worker really served from its prefix cache: the prefill
    worker's on the disaggregated path, the decode worker's on the local one."""
    decode_cached_tokens: int = 0
    """Prompt tokens the decode worker already held, so it did not pull them."""
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    transfer_seconds: float = 0.0
    fallback: str = ""
    retries: int = 0
    """Workers replaced after a failure (prefill before its first token, decode mid-stream)."""
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    e2e_seconds: float = 0.0

    def json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


class RequestFlow:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, pool: WorkerPool) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.placer = Placer(config.routing, pool.index)

    async def run(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                  request_id: str | None = None, trace: Trace | None = None
                  ) -> AsyncIterator[Delta]:
        rid = request_id or uuid.uuid4().hex
        trace = trace or Trace(rid)
        trace.prompt_tokens = len(prompt_ids)
        t0 = time.monotonic()
        text = _TextStream(self.tokenizer, prompt_ids, params)
        touched: list[Worker] = []  # workers that may still hold something of rid
        try:
            async for token_ids, reason, logprobs in self._tokens(rid, prompt_ids, params,
                                                                  priority, trace, touched):
                if not trace.ttft_seconds:
                    trace.ttft_seconds = time.monotonic() - t0
                delta = text.feed(token_ids, reason, logprobs)
                trace.output_tokens += len(delta.token_ids)
                yield delta
                if delta.finished:
                    return
        finally:
            trace.e2e_seconds = time.monotonic() - t0
            if touched:  # client gone, a stop string, or an error: free every worker
                await asyncio.shield(_abort_all(rid, list(touched)))

    async def _tokens(self, rid, prompt_ids, params, priority, trace, touched):
        """Tokens as the workers produce them, surviving worker deaths: a prefill worker
        that fails before its first token is replaced; a decode worker that fails
        mid-stream is replaced and the request re-prefilled with the tokens it already
        made, so the client sees one uninterrupted stream."""
        generated: list[int] = []
        failed: set[Worker] = set()
        for attempt in range(MAX_ATTEMPTS):
            try:
                async for toks, reason, lps in self._attempt(rid, prompt_ids, generated, params,
                                                             priority, trace, touched, failed):
                    generated.extend(toks)
                    yield toks, reason, lps
                return
            except _Retry as r:
                failed.add(r.worker)
                if r.worker in touched:
                    touched.remove(r.worker)
                # what the failed attempt left elsewhere (a prefill lease) goes now
                await asyncio.shield(_abort_all(rid, list(touched)))
                touched.clear()
                self.pool.mark_down(r.worker)
                trace.retries += 1
                trace.fallback = trace.fallback or f"{r.worker.role}_failover"
                log.warning("request %s: %s worker %s failed (%s); retrying elsewhere with %d "
                            "tokens generated", rid, r.worker.role, r.worker.name, r.reason,
                            len(generated))
        raise NoWorkerError(f"request {rid}: workers kept failing ({MAX_ATTEMPTS} attempts)")

    async def _attempt(self, rid, prompt_ids, generated, params, priority, trace, touched, failed):
        context = prompt_ids + generated
        hashes = hash_token_blocks(context, self.config.block_size, self.config.hash_seed)
        decoders = [w for w in self.pool.healthy("decode") if w not in failed]
        if not decoders:
            raise NoWorkerError("no healthy decode worker")
        need = -(-len(context) // self.config.block_size) + 1
        decode, overlap = self.placer.choose(decoders, hashes, need)
        trace.decode_worker = decode.name
        cached = overlap * self.config.block_size
        prefillers = [w for w in self.pool.healthy("prefill") if w not in failed]
        threshold = self.config.local_prefill_threshold
        gen = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                         output_token_ids=generated,
                                         sampling=sampling_to_proto(params), priority=priority,
                                         preempt_lower_priority=self.config.priority_preemption)
        if threshold >= 0 and prefillers and len(context) - cached > threshold:
            trace.path = "disaggregated"
            prefill, p_overlap = self.placer.choose(prefillers, hashes, need)
            trace.prefill_worker = prefill.name
            trace.predicted_cached_tokens = max(cached, p_overlap * self.config.block_size)
            touched.append(prefill)
            first = await self._prefill(prefill, rid, prompt_ids, generated, params, priority)
            trace.realized_cached_tokens = first.num_cached_tokens
            if first.finished:  # nothing leased
                touched.remove(prefill)
            yield [first.first_token], first.finish_reason or None, (
                [(first.first_logprob, top_from_proto(first.first_top_logprobs))]
                if first.HasField("first_logprob") else [])
            if first.finished:
                return
            gen.output_token_ids.append(first.first_token)
            gen.kv_handle.CopyFrom(first.kv_handle)
        else:
            trace.path = "local_prefill"
            trace.predicted_cached_tokens = cached
        touched.append(decode)
        decode.inflight += 1
        try:
            async for chunk in decode.stub.Generate(gen, timeout=self.config.request_timeout_s):
                if chunk.HasField("trace"):
                    _absorb(trace, chunk.trace)
                    if touched[0] is not decode:  # the decode worker released the lease
                        touched.pop(0)
                tops = [top_from_proto(t) for t in chunk.top_logprobs]
                yield list(chunk.token_ids), chunk.finish_reason or None, [
                    (lp, tops[i] if i < len(tops) else []) for i, lp in enumerate(chunk.logprobs)]
                if chunk.finished:
                    touched.remove(decode)
                    return
            raise _Retry(decode, "stream ended without a finished chunk")
        except grpc.aio.AioRpcError as e:
            if e.code() in RETRYABLE:
                raise _Retry(decode, e.code().name) from e
            raise WorkerError(e.code(), f"decode worker {decode.name}: {e.details()}") from e
        finally:
            decode.inflight -= 1

    async def _prefill(self, w: Worker, rid, prompt_ids, generated, params, priority):
        w.inflight += 1
        try:
            return await w.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, token_ids=prompt_ids, output_token_ids=generated,
                sampling=sampling_to_proto(params), priority=priority),
                timeout=self.config.request_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in RETRYABLE:
                raise _Retry(w, e.code().name) from e
            raise WorkerError(e.code(), f"prefill worker {w.name}: {e.details()}") from e
        finally:
            w.inflight -= 1


class _Retry(Exception):
    """A worker failed in a way another worker can make good."""

    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker, self.reason = worker, reason


def _absorb(trace: Trace, t: decode_pb2.KVTrace) -> None:
    trace.decode_cached_tokens = t.local_cached_tokens
    if trace.path == "local_prefill":
        trace.realized_cached_tokens = t.local_cached_tokens
    trace.blocks_pulled += t.blocks_pulled
    trace.bytes_pulled += t.bytes_pulled
    trace.transfer_seconds += t.transfer_seconds
    if t.fallback:
        trace.fallback = t.fallback


async def _abort_all(rid: str, workers: list[Worker]) -> None:
    for w in workers:
        try:
            await w.stub.Abort(common.AbortRequest(request_id=rid), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.warning("abort of %s on %s failed: %s", rid, w.name, e.details())


class _TextStream:
    """Detokenization and stop strings for the client's text (hold-back applied)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                     if params.stop else None)

    def feed(self, token_ids: list[int], reason: str | None, logprobs: list[Logprob]) -> Delta:
        text = "".join(self.detok.add(t) for t in token_ids)
        if reason is not None:  # the end: what was held back for a split character goes out
            text += self.detok.flush()
        if self.stop is not None:
            text, hit = self.stop.feed(text)
            if hit:
                return Delta(text, token_ids, True, "stop", logprobs)
            if reason is not None:
                text += self.stop.flush()
        return Delta(text, token_ids, reason is not None, reason, logprobs)
