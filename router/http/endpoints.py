"""The OpenAI endpoints: validate, queue for admission, run the flow, render.

Each request's resources (its admission slot, the in-flight gauge, its flow through
the workers, its accounting) live in one AsyncExitStack. A non-streaming response
closes it before returning; a streaming response owns it and closes it when the
stream ends, fails or is cancelled. The edge guard cancels the handler when the
client goes away, so in every case the stack unwinds: the slot is released, the
flow aborts what its workers hold, and the request is accounted exactly once.
"""
from __future__ import annotations

import time
import uuid
from contextlib import AsyncExitStack
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest

from core.kv import blocks_for
from router.flow import Delta
from router.http.errors import APIError
from router.http.batch import serve_batch
from router.http.responses import serve_responses
from router.http.tokens import TokenReader
from router.http.intake import Intake, Reader
from router.http.owned import FLOW_ERRORS, Outcome, OwnedStream, echo_headers
from router.http.echo import PromptPart
from router.http.render import LogprobFormat, ResponseShape
from router.state import RouterState
from router.tools import ToolCallText
from router.trace import Trace
from router import spans as router_spans
from tracing import spans

class Endpoints:
    def __init__(self, state: RouterState) -> None:
        self.state = state

    # -- plain endpoints -------------------------------------------------------------
    async def health(self) -> dict:
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        pool = self.state.pool
        ok = bool(pool.healthy("decode"))
        body = {"ready": ok, "prefill": len(pool.healthy("prefill")),
                "decode": len(pool.healthy("decode"))}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self) -> PlainTextResponse:
        m = self.state.metrics
        for role in ("prefill", "decode"):
            m.healthy.labels(role=role).set(len(self.state.pool.healthy(role)))
        m.worker_kv_blocks.clear()  # workers come and go: only the current ones
        for w in self.state.pool.workers:
            if w.load.total_blocks:
                m.worker_kv_blocks.labels(worker=w.address, state="free").set(w.load.free_blocks)
                m.worker_kv_blocks.labels(worker=w.address, state="total").set(w.load.total_blocks)
        return PlainTextResponse(generate_latest(m.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        """The base model, then each LoRA adapter the workers serve with the base as its
        parent (vLLM's shape)."""
        base = self.state.model_name
        data = [{"id": base, "object": "model", "created": 0, "owned_by": "tandem",
                 "root": base, "parent": None}]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "tandem",
                  "root": a.path, "parent": base} for name, a in self.state.loras.served().items()]
        return {"object": "list", "data": data}

    async def lora_admin(self, request: Request, handler) -> Response:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter (router/http/lora_admin.py)."""
        try:
            return await handler(self.state, request)
        except APIError as e:
            return e.response({})

    # -- tokenizer ---------------------------------------------------------------------
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
        try:
            ids, strs = await TokenReader(self.state).tokenize(request)
        except APIError as e:
            return e.response(echo_headers(request, f"tok-{uuid.uuid4().hex}"))
        tok = self.state.tokenizer
        return JSONResponse({"count": len(ids), "max_model_len": self.state.config.max_model_len,
                             "tokens": ids, "token_strs": [
                                 tok.decode([t], skip_special_tokens=False) for t in ids]
                             if strs else None})

    async def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the special tokens, the chat template and the context
        window (lm-evaluation-harness's remote tokenizer reads it, then tokenizes
        through /tokenize, so it counts tokens exactly as the workers do)."""
        tok = self.state.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                "unk_token": tok.unk_token, "add_bos_token": tok.add_bos,
                "chat_template": tok.chat_template,
                "model_max_length": self.state.config.max_model_len}

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: {prompt} (special tokens kept, as vLLM decodes)."""
        try:
            ids = await TokenReader(self.state).detokenize(request)
        except APIError as e:
            return e.response(echo_headers(request, f"tok-{uuid.uuid4().hex}"))
        text = await self.state.parsing.run(self.state.tokenizer.decode, ids, False)
        return JSONResponse({"prompt": text})

    async def responses(self, request: Request) -> Response:
        return await serve_responses(self, request)

    # -- completions ------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            intakes = await Reader(self.state).completions(request)
        except APIError as e:
            return e.response(echo_headers(request, rid))
        if len(intakes) == 1 and intakes[0].params.n == 1:
            return await self._serve(request, intakes[0], rid)
        return await serve_batch(self, request, intakes, rid)

    async def chat(self, request: Request) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            intake = await Reader(self.state).chat(request)
        except APIError as e:
            return e.response(echo_headers(request, rid))
        if intake.params.n > 1:  # n choices of one flow (batch.py)
            return await serve_batch(self, request, [intake], rid)
        return await self._serve(request, intake, rid)

    async def _serve(self, request: Request, intake: Intake, rid: str) -> Response:
        headers = echo_headers(request, rid)
        stack = AsyncExitStack()
        outcome = Outcome(Trace(rid, request.headers.get("x-request-id") or ""))
        try:
            deltas = await self.start(stack, intake, rid, outcome)
            first = await deltas.__anext__()
            self.state.metrics.ttft.observe(outcome.trace.ttft_seconds)
            shape = self.shape(intake, rid, outcome.trace)
            if intake.stream:
                resp = OwnedStream(self._sse(first, deltas, shape, outcome), stack, headers)
                stack = None  # the response owns it now
                return resp
            text, reason, ids, lps = await _collect(first, deltas)
            full = shape.full(text, reason, ids, lps, outcome.trace, first.prompt_logprobs)
            outcome.reason = full["choices"][0]["finish_reason"] or "error"
            return JSONResponse(full, headers=headers)
        except FLOW_ERRORS as e:
            outcome.reason = "error"
            return APIError.from_flow(e).response(headers)
        finally:
            if stack is not None:
                await stack.aclose()

    async def start(self, stack: AsyncExitStack, intake: Intake, rid: str,
                    outcome: Outcome) -> AsyncIterator[Delta]:
        """Admit the request and start its flow, everything it holds on ``stack``: its
        admission slot, the in-flight gauge, its accounting (once, when the stack
        closes) and its flow (closing it aborts whatever the workers still hold)."""
        st = self.state
        blocks = blocks_for(len(intake.prompt_ids) + 1, st.config.block_size)
        with spans.phase("router.queue", {"tandem.priority": intake.priority}):
            outcome.trace.queue_seconds = await stack.enter_async_context(
                st.admission.slot(intake.priority, intake.deadline, blocks))
        stack.callback(self._account, outcome)
        stack.enter_context(st.loras.running(intake.lora))  # an unload waits for it
        st.metrics.in_flight.inc()
        stack.callback(st.metrics.in_flight.dec)
        deltas = st.flow.run(intake.prompt_ids, intake.params, intake.priority, rid,
                             outcome.trace, intake.deadline, intake.cache_salt, intake.lora,
                             intake.kv_policy)
        stack.push_async_callback(deltas.aclose)
        return deltas

    def shape(self, intake: Intake, rid: str, trace: Trace, index: int = 0) -> ResponseShape:
        """trace: the request's (its usage so far goes out with each chunk when asked)."""
        st = self.state
        return ResponseShape(rid, int(time.time()), intake.lora or st.model_name, intake.chat,
                             LogprobFormat(st.tokenizer, intake.chat, intake.tokens_as_ids)
                             if intake.logprobs is not None else None,
                             intake.include_usage, intake.tools,
                             intake.prompt_ids if intake.return_token_ids else None, index,
                             PromptPart.of(st.tokenizer, intake),
                             trace if intake.continuous_usage else None)

    async def _sse(self, first: Delta, deltas: AsyncIterator[Delta], shape: ResponseShape,
                   outcome: Outcome) -> AsyncIterator[str]:
        m = self.state.metrics
        opening = True  # the first chunk carries prompt_token_ids when asked
        if shape.chat:
            yield shape.chunk(None, None, role=True, first=True)
            opening = False
        d, last = first, time.monotonic()
        calls = ToolCallText(shape.tools) if shape.tools is not None else None
        ids_wanted = shape.logprobs is not None or shape.prompt_ids is not None
        try:
            while True:
                text = d.text if calls is None else calls.feed(d.text)
                if text or (ids_wanted and d.token_ids) or (opening and shape.prompt):
                    yield shape.chunk(text, None, d=d, first=opening)
                    opening = False
                if d.finished:
                    outcome.reason = d.finish_reason or "error"
                    break
                d = await deltas.__anext__()
                now = time.monotonic()
                m.itl.observe(now - last)
                last = now
            if calls is not None:
                owed, found = calls.finish(d.finish_reason)
                if owed:
                    yield shape.chunk(owed, None)
                if found:
                    outcome.reason = "tool_calls"
                    for event in shape.tool_call_chunks(found):
                        yield event
            yield shape.chunk(None if shape.chat else "", outcome.reason)
            if shape.include_usage:
                yield shape.usage_chunk(outcome.trace)
            yield "data: [DONE]\n\n"
        except (StopAsyncIteration, *FLOW_ERRORS) as e:
            outcome.reason = "error"
            yield shape.error_event(str(e) or "stream ended early")

    def _account(self, outcome: Outcome) -> None:
        """Once per request, whatever its end: metrics and the request log line."""
        st, trace = self.state, outcome.trace
        m = st.metrics
        m.requests.labels(path=trace.path.value if trace.path is not None else "none",
                          finish_reason=outcome.reason).inc()
        m.prompt_tokens.inc(trace.prompt_tokens)
        m.generation_tokens.inc(trace.output_tokens)
        m.e2e.observe(trace.e2e_seconds)
        m.predicted_hits.inc(trace.predicted_cached_tokens)
        m.realized_hits.inc(trace.realized_cached_tokens)
        m.kv_bytes.inc(trace.bytes_pulled)
        m.queue_time.observe(trace.queue_seconds)
        if st.request_log is not None:
            st.request_log.write(trace.json() + "\n")
        router_spans.finish_request(trace.fields(), outcome.reason)


async def _collect(first: Delta, deltas: AsyncIterator[Delta]):
    parts, reason = [first.text], first.finish_reason
    ids, lps = list(first.token_ids), list(first.logprobs)
    if not first.finished:
        async for d in deltas:
            parts.append(d.text)
            ids.extend(d.token_ids)
            lps.extend(d.logprobs)
            if d.finished:
                reason = d.finish_reason
                break
    return "".join(parts), reason, ids, lps
