"""The OpenAI endpoints: validate, queue for admission, run the flow, render.

Each request's resources (its admission slot, the in-flight gauge, its flow through
the workers, its accounting) live in one AsyncExitStack. A non-streaming response
closes it before returning; a streaming response owns it and closes it when the
stream ends, fails or is cancelled. The edge guard cancels the handler when the
client goes away, so in every case the stack unwinds: the slot is released, the
flow aborts what its workers hold, and the request is accounted exactly once.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from engine.kv_cache import blocks_for
from engine.limits import check_priority, check_prompt
from router.flow import Delta, Trace
from router.http.errors import APIError
from router.http.render import LogprobFormat, ResponseShape
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.outcomes import DeadlineExceeded, NoWorkerError, QueueFull, WorkerError
from router.state import RouterState
from router.structured import Constraint, constraint_of
from router.tools import ToolCallText, ToolPlan, template_messages
from router import spans as router_spans
from tracing import spans

FLOW_ERRORS = (NoWorkerError, WorkerError, DeadlineExceeded, QueueFull)


@dataclass
class _Outcome:
    trace: Trace
    reason: str = "abort"
    """How the request ended for the client; abort unless something else is known."""


class OwnedStream(StreamingResponse):
    """An SSE response that owns its request's resources: they are released when
    the stream ends, fails, or is cancelled because the client went away."""

    def __init__(self, content: AsyncIterator[str], stack: AsyncExitStack,
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._stack = stack

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._stack.aclose()


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
        return PlainTextResponse(generate_latest(m.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.state.model_name, "object": "model",
                                            "created": 0, "owned_by": "tandem"}]}

    # -- completions ------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        tok = self.state.tokenizer
        if isinstance(body.prompt, str):  # tokenizing is CPU work: off the event loop
            ids = await asyncio.to_thread(tok.encode, body.prompt)
        else:
            ids = list(body.prompt)
        try:
            constraint = constraint_of(body)
        except APIError as e:
            return e.response(_echo(request, ""))
        return await self._serve(request, body, ids, chat=False, logprobs=body.logprobs,
                                 constraint=constraint)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            constraint = constraint_of(body)
            ids = await asyncio.to_thread(self._chat_ids, messages, constraint.tools)
        except APIError as e:
            return e.response(_echo(request, ""))
        except ValueError as e:
            return APIError(400, str(e), param="messages").response(_echo(request, ""))
        lp = (body.top_logprobs or 0) if body.logprobs else None
        return await self._serve(request, body, ids, chat=True, logprobs=lp,
                                 constraint=constraint)

    def _chat_ids(self, messages: list[dict], tools: ToolPlan | None) -> list[int]:
        tok = self.state.tokenizer
        messages, extra = template_messages(messages, tools, tok.chat_template)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        return tok.encode(text, add_special_tokens=False)

    async def _serve(self, request: Request, body, prompt_ids: list[int], chat: bool,
                     logprobs: int | None, constraint: Constraint) -> Response:
        st = self.state
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        headers = _echo(request, rid)
        try:
            priority, deadline = self._priority(request, body), self._deadline(request)
            params = self._check(body, prompt_ids, logprobs, constraint.spec)
            if params.guided is not None:  # compiling is CPU work: off the event loop
                await asyncio.to_thread(self._compile, params, constraint.field)
        except APIError as e:
            return e.response(headers)
        stack = AsyncExitStack()
        outcome = _Outcome(Trace(rid, request.headers.get("x-request-id") or ""))
        try:
            blocks = blocks_for(len(prompt_ids) + 1, st.config.block_size)
            with spans.phase("router.queue", {"tandem.priority": priority}):
                outcome.trace.queue_seconds = await stack.enter_async_context(
                    st.admission.slot(priority, deadline, blocks))
            stack.callback(self._account, outcome)
            st.metrics.in_flight.inc()
            stack.callback(st.metrics.in_flight.dec)
            deltas = st.flow.run(prompt_ids, params, priority, rid, outcome.trace, deadline)
            stack.push_async_callback(deltas.aclose)
            first = await deltas.__anext__()
            st.metrics.ttft.observe(outcome.trace.ttft_seconds)
            shape = ResponseShape(rid, int(time.time()), st.model_name, chat,
                                  LogprobFormat(st.tokenizer, chat) if logprobs is not None
                                  else None,
                                  bool(body.stream_options and body.stream_options.include_usage),
                                  constraint.tools)
            if body.stream:
                resp = OwnedStream(self._sse(first, deltas, shape, outcome), stack, headers)
                stack = None  # the response owns it now
                return resp
            text, reason, ids, lps = await _collect(first, deltas)
            full = shape.full(text, reason, ids, lps, outcome.trace)
            outcome.reason = full["choices"][0]["finish_reason"] or "error"
            return JSONResponse(full, headers=headers)
        except FLOW_ERRORS as e:
            outcome.reason = "error"
            return APIError.from_flow(e).response(headers)
        finally:
            if stack is not None:
                await stack.aclose()

    def _check(self, body, prompt_ids: list[int], logprobs: int | None, guided=None):
        """SamplingParams for the request; APIError (400) naming the field otherwise."""
        st = self.state
        if body.model not in (None, "", st.model_name):
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{st.model_name!r}", param="model")
        try:
            check_prompt(prompt_ids, st.tokenizer.vocab_size, st.config.max_model_len,
                         max_tokens=body.max_tokens)
            return body.sampling(st.config.default_max_tokens, logprobs, guided)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from e

    def _compile(self, params, field: str) -> None:
        """The constraint compiles and a complete output fits in max_tokens (the same
        check every worker makes), or APIError (400) naming the field."""
        try:
            self.state.flow.guided.check(params.guided, params.max_tokens, field)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from e

    def _priority(self, request: Request, body) -> int:
        """The request's priority (x-priority wins over the body's), within its API key's
        ceiling: a key whose ceiling is 5 cannot claim priority 0 (403)."""
        header = request.headers.get("x-priority")
        priority = body.priority
        if header is not None:
            try:
                priority = check_priority(int(header), "x-priority")
            except ValueError as e:
                raise APIError(400, f"x-priority header must be an integer in the int32 range, "
                                    f"got {header!r}", param="x-priority") from e
        key = getattr(request.state, "api_key", None)
        if key is not None and key.priority_ceiling is not None and priority < key.priority_ceiling:
            raise APIError(403, f"priority {priority} is more important than API key "
                                f"{key.name!r} may claim (its ceiling is {key.priority_ceiling}; "
                                "lower values are more important)", "permission_error",
                           param="x-priority" if header is not None else "priority")
        return priority

    def _deadline(self, request: Request) -> float:
        header = request.headers.get("x-request-timeout")
        timeout = self.state.config.request_timeout_s
        if header is not None:
            try:
                value = float(header)
                if not value > 0:
                    raise ValueError
            except ValueError:
                raise APIError(400, f"x-request-timeout must be seconds > 0, got {header!r}",
                               param="x-request-timeout") from None
            timeout = min(timeout, value)
        return time.monotonic() + timeout

    async def _sse(self, first: Delta, deltas: AsyncIterator[Delta], shape: ResponseShape,
                   outcome: _Outcome) -> AsyncIterator[str]:
        m = self.state.metrics
        if shape.chat:
            yield shape.chunk(None, None, role=True)
        d, last = first, time.monotonic()
        calls = ToolCallText(shape.tools) if shape.tools is not None else None
        try:
            while True:
                text = d.text if calls is None else calls.feed(d.text)
                if text or (shape.logprobs is not None and d.token_ids):
                    yield shape.chunk(text, None, d=d)
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

    def _account(self, outcome: _Outcome) -> None:
        """Once per request, whatever its end: metrics and the request log line."""
        st, trace = self.state, outcome.trace
        m = st.metrics
        m.requests.labels(path=trace.path or "none", finish_reason=outcome.reason).inc()
        m.prompt_tokens.inc(trace.prompt_tokens)
        m.generation_tokens.inc(trace.output_tokens)
        m.e2e.observe(trace.e2e_seconds)
        m.predicted_hits.inc(trace.predicted_cached_tokens)
        m.realized_hits.inc(trace.realized_cached_tokens)
        m.kv_bytes.inc(trace.bytes_pulled)
        m.queue_time.observe(trace.queue_seconds)
        if st.request_log is not None:
            st.request_log.write(trace.json() + "\n")
        router_spans.finish_request(vars(trace), outcome.reason)


def _echo(request: Request, rid: str) -> dict[str, str]:
    """x-request-id: the client's, echoed; else the id the router minted."""
    return {"x-request-id": request.headers.get("x-request-id") or rid}


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
