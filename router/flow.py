"""One request's life through the cluster, as the router drives it.

1. hash the prompt's full blocks; pick a decode worker (prefix overlap vs load);
2. if the uncached part is short, the decode worker prefills it itself
   (conditional disaggregation); else pick a prefill worker, get the first token
   and a KVHandle, and stream that token to the client at once;
3. stream the decode worker's tokens; detokenize and apply stop strings here,
   where the client's text is produced.
If the client goes away, the request is aborted on every worker it touched.

Identity: the router mints the request id (``rid``). Each attempt on the workers
runs under its own id, ``{rid}-{attempt}``, so a retry never collides with what
an earlier attempt left behind (a lease, a held table) and the workers can refuse
any duplicate id outright. One deadline bounds the whole request, retries included.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from opentelemetry.trace import Span

from core.guided.compiler import GrammarCompiler
from core.kv import BlockHash, blocks_for, hash_token_blocks, lora_salt
from core.sampling import SamplingParams
from core.text import TextAssembler
from core.tokenizer import Tokenizer
from proto import common_pb2 as common
from proto import decode_pb2, prefill_pb2
from router.config import RouterConfig
from router.outcomes import DeadlineExceeded, NoWorkerError, WorkerError
from router.placement import Placer
from router.trace import Failover, RequestPath, Trace
from router.workers import Worker, WorkerPool
from router import spans as router_spans
from tracing.spans import calling
from proto.convert import FALLBACK, field_of
from proto.convert import prompt_logprobs_from_proto, sampling_to_proto, top_from_proto

log = logging.getLogger(__name__)


MAX_ATTEMPTS = 3
# A worker that died, stopped answering or is shutting down; another can take the
# request over. UNKNOWN is not here: it is what an unhandled error in a handler looks
# like, and retrying it would let one poison request mark every worker down.
# UNAUTHENTICATED: that worker holds another cluster secret; another worker may not
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNAUTHENTICATED}


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
    prompt_logprobs: list[Logprob] | None = None
    """On the first delta, when SamplingParams.prompt_logprobs asked: one per prompt
    token after the first (computed by the worker that ran the prompt)."""
    index: int = 0
    """Which of the request's n choices (SamplingParams.n) it belongs to."""


class RequestFlow:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, pool: WorkerPool) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.placer = Placer(config.routing, pool.index)
        self.guided = GrammarCompiler(tokenizer)
        """Constraints compiled and checked at the edge (the workers check them again)."""

    async def run(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                  request_id: str | None = None, trace: Trace | None = None,
                  deadline: float | None = None, cache_salt: bytes = b"", lora: str = "",
                  kv_policy: str = "") -> AsyncIterator[Delta]:
        """The client's deltas. deadline (time.monotonic()): DeadlineExceeded once it
        passes; default now + request_timeout_s. cache_salt (router/cache_salt.py):
        the prefix cache its blocks belong to, on every worker and every attempt. lora:
        the LoRA adapter it runs under ("": the base model); only workers serving it
        take it. kv_policy: its KV policy, the same to both workers ("": theirs)."""
        rid = request_id or uuid.uuid4().hex
        trace = trace or Trace(rid)
        trace.prompt_tokens, trace.lora = len(prompt_ids), lora
        t0 = time.monotonic()
        req = _Request(rid, prompt_ids, params, priority,
                       deadline or t0 + self.config.request_timeout_s, cache_salt, lora,
                       kv_policy=kv_policy)
        texts = [_TextStream(self.tokenizer, prompt_ids, params, accept)
                 for accept in await self._acceptors(params)]
        left = params.n
        try:
            seen: set[int] = set()
            async for token_ids, reason, logprobs, index in self._tokens(req, trace):
                if not trace.ttft_seconds:
                    trace.ttft_seconds = time.monotonic() - t0
                delta = texts[index].feed(token_ids, reason, logprobs)
                delta.index = index
                if index not in seen:  # the prompt's logprobs came with (before) its first token
                    seen.add(index)
                    delta.prompt_logprobs = req.prompt_logprobs
                trace.output_tokens += len(delta.token_ids)
                left -= delta.finished
                yield delta
                if left == 0:
                    return
        finally:
            trace.e2e_seconds = time.monotonic() - t0
            # client gone, a stop string, or an error: free what any worker still holds
            await asyncio.shield(req.held.abort_all())

    async def _acceptors(self, params: SamplingParams) -> list:
        """Each choice's stop-string acceptor (a grammar's state, started off the loop),
        or None each when the request has no constraint and stop strings."""
        if params.guided is None or not params.stop:
            return [None] * params.n
        return [await asyncio.to_thread(self.guided.acceptor, params.guided, params.stop)
                for _ in range(params.n)]

    async def _tokens(self, req: _Request, trace: Trace):
        """Tokens as the workers produce them, surviving worker deaths: a prefill worker
        that fails before its first token is replaced; a decode worker that fails
        mid-stream is replaced and the request re-prefilled with the tokens it already
        made, so the client sees one uninterrupted stream."""
        failed: set[Worker] = set()
        for attempt in range(MAX_ATTEMPTS):
            try:
                async for toks, reason, lps, index in self._attempt(
                        req, f"{req.rid}-{attempt}", trace, failed):
                    req.generated.extend(toks)
                    yield toks, reason, lps, index
                return
            except _Retry as r:
                if req.params.n > 1 and req.generated:  # the choices are not resumed
                    raise NoWorkerError(f"request {req.rid}: {r.worker.role} worker "
                                        f"{r.worker.name} failed ({r.reason}) after its first "
                                        "tokens; n > 1 choices are not resumed elsewhere") from r
                failed.add(r.worker)
                req.held.forget(r.worker)
                # what the failed attempt left elsewhere (a prefill lease) goes now
                await asyncio.shield(req.held.abort_all())
                self.pool.mark_down(r.worker)
                trace.retries += 1
                router_spans.retry(r.worker, r.reason, attempt, len(req.generated))
                trace.fallback = trace.fallback or Failover.of(r.worker.role)
                log.warning("request %s: %s worker %s failed (%s); retrying elsewhere with %d "
                            "tokens generated", req.rid, r.worker.role, r.worker.name, r.reason,
                            len(req.generated))
        raise NoWorkerError(f"request {req.rid}: workers kept failing ({MAX_ATTEMPTS} attempts)")

    async def _attempt(self, req: _Request, wid: str, trace: Trace, failed: set[Worker]):
        """One try: (optionally) prefill on a prefill worker, then stream from a decode
        worker, both under the worker-level id wid."""
        context = req.prompt_ids + req.generated
        bs = self.config.block_size
        hashes = _Chains(context, bs, self.config.hash_seed, req)
        decoders = [w for w in self.pool.healthy("decode")
                    if w not in failed and w.lora_identity(req.lora) is not None]
        if not decoders:
            raise NoWorkerError("no healthy decode worker" + (
                f" serves the LoRA adapter {req.lora!r}" if req.lora else ""))
        need = blocks_for(len(context), bs) + 1
        decode, overlap = self.placer.choose(decoders, hashes, need)
        trace.decode_worker = decode.name
        cached = overlap * bs
        # a prefill worker must hold the adapter's very files: the decode worker
        # refuses KV made under other weights
        prefillers = [w for w in self.pool.healthy("prefill") if w not in failed
                      and w.lora_identity(req.lora) == decode.lora_identity(req.lora)]
        gen = decode_pb2.GenerateRequest(request_id=wid, prompt_token_ids=req.prompt_ids,
                                         output_token_ids=req.generated,
                                         sampling=req.sampling(), priority=req.priority,
                                         preempt_lower_priority=self.config.priority_preemption,
                                         cache_salt=req.cache_salt, lora_name=req.lora,
                                         kv_policy=req.kv_policy)
        threshold = self.config.local_prefill_threshold
        if threshold is not None and prefillers and len(context) - cached > threshold:
            trace.path = RequestPath.DISAGGREGATED
            prefill, p_overlap = self.placer.choose(prefillers, hashes, need)
            trace.prefill_worker = prefill.name
            trace.predicted_cached_tokens = max(cached, p_overlap * bs)
            with router_spans.prefill_call(prefill, wid) as span:
                first = await self._prefill(prefill, wid, req)
                router_spans.prefill_reply(span, first)
            trace.realized_cached_tokens = first.num_cached_tokens
            trace.realized_host_cached_tokens = first.num_host_cached_tokens
            trace.realized_disk_cached_tokens = first.num_disk_cached_tokens
            gen.sampling.ClearField("prompt_logprobs")  # the prefill worker returned them
            if first.HasField("prompt_logprobs"):
                req.prompt_logprobs = prompt_logprobs_from_proto(first.prompt_logprobs)
            if first.finished and req.params.n > 1:
                # choice 0 ended at its first token, so nothing was leased: the decode
                # worker runs the whole request (with a seed, choice 0 comes out the same)
                trace.path = RequestPath.LOCAL_PREFILL
            else:
                # a max_tokens 0 request ends after its prompt: no first token
                yield [first.first_token] if req.params.max_tokens else [], \
                    first.finish_reason or None, (
                        [(first.first_logprob, top_from_proto(first.first_top_logprobs))]
                        if first.HasField("first_logprob") else []), 0
                if first.finished:
                    return
                gen.output_token_ids.append(first.first_token)
                gen.kv_handle.CopyFrom(first.kv_handle)
        else:
            trace.path = RequestPath.LOCAL_PREFILL
            trace.predicted_cached_tokens = cached
        with router_spans.decode_call(decode, wid) as span:
            async for item in self._decode(decode, wid, gen, req, trace, span):
                yield item

    async def _decode(self, decode: Worker, wid: str, gen, req: _Request, trace: Trace,
                      span: Span):
        req.held.add(decode, wid)
        decode.inflight += 1
        left = req.params.n  # the stream ends after every choice's last chunk
        try:
            with calling(span):  # the call carries the span's traceparent
                stream = decode.stub.Generate(gen, timeout=req.remaining())
            async for chunk in stream:
                if chunk.HasField("trace"):
                    _absorb(trace, chunk.trace)
                    router_spans.kv_trace(span, chunk.trace)
                    if chunk.trace.lease_ended:  # the decode worker released the lease
                        req.held.forget_role("prefill")
                    else:  # it did not (or could not): end it now, not at its expiry
                        req.held.abort_role_soon("prefill")
                if chunk.HasField("spec"):
                    trace.spec_proposed_tokens += chunk.spec.proposed_tokens
                    trace.spec_accepted_tokens += chunk.spec.accepted_tokens
                    trace.spec_verifications += chunk.spec.verifications
                if chunk.HasField("prompt_logprobs") and req.prompt_logprobs is None:
                    req.prompt_logprobs = prompt_logprobs_from_proto(chunk.prompt_logprobs)
                tops = [top_from_proto(t) for t in chunk.top_logprobs]
                # an error or an abort ends the whole request (the worker stops there too)
                left = 0 if chunk.finish_reason in ("error", "abort") else left - chunk.finished
                if left == 0:  # nothing may resume this generator after the yield
                    router_spans.decode_done(span, chunk)
                    req.held.forget(decode)  # it ended there: nothing left to abort
                if chunk.finish_reason == "error":  # the request's own failure: no retry
                    raise WorkerError(grpc.StatusCode.INTERNAL, f"decode worker {decode.name}: "
                                      f"{chunk.error or 'the request failed'}")
                yield list(chunk.token_ids), chunk.finish_reason or None, [
                    (lp, tops[i] if i < len(tops) else []) for i, lp in enumerate(chunk.logprobs)
                ], chunk.index
                if left == 0:
                    return
            raise _Retry(decode, "stream ended without a finished chunk")
        except grpc.aio.AioRpcError as e:
            raise _failure(decode, e, req) from e
        finally:
            decode.inflight -= 1

    async def _prefill(self, w: Worker, wid: str, req: _Request):
        req.held.add(w, wid)
        w.inflight += 1
        try:
            first = await w.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=wid, token_ids=req.prompt_ids, output_token_ids=req.generated,
                sampling=req.sampling(), priority=req.priority,
                cache_salt=req.cache_salt, lora_name=req.lora, kv_policy=req.kv_policy,
                router_id=self.pool.router_id),
                timeout=req.remaining())
        except grpc.aio.AioRpcError as e:
            raise _failure(w, e, req) from e
        finally:
            w.inflight -= 1
        if first.finished:  # nothing leased
            req.held.forget(w)
        return first


@dataclass
class _Request:
    """One client request as the flow carries it across attempts."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float
    cache_salt: bytes = field(default=b"", repr=False)
    """router/cache_salt.py; kept out of repr (it names a tenant's cache)."""
    lora: str = ""
    """The LoRA adapter's name ("": the base model)."""
    generated: list[int] = field(default_factory=list)
    held: _Held = field(default_factory=lambda: _Held())
    prompt_logprobs: list[Logprob] | None = None
    """The prompt's logprobs once a worker returned them (params.prompt_logprobs)."""
    kv_policy: str = ""
    """Its KV policy as the client gave it ("": the workers' --kv-policy)."""

    def sampling(self) -> common.SamplingParams:
        """The params as the workers get them: a retry does not ask for the prompt's
        logprobs again once an earlier attempt returned them."""
        m = sampling_to_proto(self.params)
        if self.prompt_logprobs is not None:
            m.ClearField("prompt_logprobs")
        return m

    def remaining(self) -> float:
        """Seconds left before the deadline (DeadlineExceeded when none)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.rid}: its deadline passed")
        return left


class _Chains:
    """The prompt's block hashes as each worker computes them: under the request's salt,
    and under a LoRA adapter with its identity there folded in (core/kv lora_salt), so
    placement finds the blocks that worker cached under that adapter. One chain per
    identity, computed when first asked."""

    def __init__(self, context: list[int], block_size: int, seed: int, req: _Request) -> None:
        self.context, self.block_size, self.seed, self.req = context, block_size, seed, req
        self._by_identity: dict[bytes, list[BlockHash]] = {}

    def __call__(self, worker: Worker) -> list[BlockHash]:
        identity = worker.lora_identity(self.req.lora) or b""
        chain = self._by_identity.get(identity)
        if chain is None:
            salt = lora_salt(self.req.cache_salt, identity) if identity else self.req.cache_salt
            chain = hash_token_blocks(self.context, self.block_size, self.seed, salt=salt)
            self._by_identity[identity] = chain
        return chain


class _Held:
    """Workers that may still hold something of the request (a lease, blocks, a
    running stream), each with the worker-level id to abort there."""

    def __init__(self) -> None:
        self._ids: dict[Worker, str] = {}

    def add(self, worker: Worker, wid: str) -> None:
        self._ids[worker] = wid

    def forget(self, worker: Worker) -> None:
        self._ids.pop(worker, None)

    def forget_role(self, role: str) -> dict[Worker, str]:
        gone = {w: wid for w, wid in self._ids.items() if w.role == role}
        for w in gone:
            del self._ids[w]
        return gone

    def abort_role_soon(self, role: str) -> None:
        """Abort what the role's workers hold, in the background (the stream goes on)."""
        held = self.forget_role(role)
        if held:
            task = asyncio.ensure_future(_abort(held))
            _ABORTING.add(task)
            task.add_done_callback(_ABORTING.discard)

    async def abort_all(self) -> None:
        held, self._ids = self._ids, {}
        await _abort(held)


_ABORTING: set[asyncio.Task] = set()
"""Background aborts in flight (a reference each, so none is collected unfinished)."""


async def _abort(held: dict[Worker, str]) -> None:
    """Abort each worker-level id on its worker (a failure is logged: the worker frees
    it at its lease's expiry, or it is gone)."""
    for w, wid in held.items():
        try:
            await w.stub.Abort(common.AbortRequest(request_id=wid), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.warning("abort of %s on %s failed: %s", wid, w.name, e.details())


def _failure(worker: Worker, e: grpc.aio.AioRpcError, req: _Request) -> Exception:
    """What a failed worker call becomes: a retry elsewhere, the deadline, or an error."""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"request {req.rid}: {worker.role} worker {worker.name}: "
                                f"{e.details()}")
    if e.code() in RETRYABLE:
        return _Retry(worker, e.code().name)
    return WorkerError(e.code(), f"{worker.role} worker {worker.name}: {e.details()}",
                       field_of(e.trailing_metadata()))


class _Retry(Exception):
    """A worker failed in a way another worker can make good."""

    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker, self.reason = worker, reason


def _absorb(trace: Trace, t: decode_pb2.KVTrace) -> None:
    trace.decode_cached_tokens = t.local_cached_tokens
    trace.decode_host_cached_tokens = t.local_host_cached_tokens
    trace.decode_disk_cached_tokens = t.local_disk_cached_tokens
    if trace.path is RequestPath.LOCAL_PREFILL:
        trace.realized_cached_tokens = t.local_cached_tokens
        trace.realized_host_cached_tokens = t.local_host_cached_tokens
        trace.realized_disk_cached_tokens = t.local_disk_cached_tokens
    trace.blocks_pulled += t.blocks_pulled
    trace.bytes_pulled += t.bytes_pulled
    trace.transfer_seconds += t.transfer_seconds
    reason = FALLBACK.from_proto(t.fallback)
    if reason is not None:
        trace.fallback = reason


class _TextStream:
    """The client's text (core/text.py) turned into Deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 accept=None) -> None:
        self.text = TextAssembler.for_params(tokenizer, prompt_ids, params, accept)

    def feed(self, token_ids: list[int], reason: str | None, logprobs: list[Logprob]) -> Delta:
        text, hit = self.text.add(token_ids)
        if not hit and reason is not None:  # the end: what was held back goes out
            tail, hit = self.text.close()
            text += tail
        if hit:
            return Delta(text, token_ids, True, "stop", logprobs)
        return Delta(text, token_ids, reason is not None, reason, logprobs)
