"""The HTTP edge: OpenAI-compatible endpoints over RequestFlow.

Errors are OpenAI error objects ({"error": {message, type, param, code}}) with
the matching HTTP status; the request id (x-request-id, generated if absent) is
echoed on every response.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.background import BackgroundTask

from engine.tokenizer import Tokenizer
from router.admission import Admission, DeadlineExceeded, QueueFull
from router.config import RouterConfig
from router.flow import Delta, Logprob, NoWorkerError, RequestFlow, Trace, WorkerError
from router.metrics import RouterMetrics
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.workers import WorkerPool

log = logging.getLogger(__name__)
_GRPC_TO_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                 grpc.StatusCode.FAILED_PRECONDITION: 500, grpc.StatusCode.UNAVAILABLE: 503,
                 grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self, rid: str) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status, headers={"x-request-id": rid})


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    model_name = config.model_name or Path(config.model).name.removesuffix(".gguf")
    state: dict = {}

    discovery = config.make_discovery()  # config errors surface before serving

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tok = tokenizer or Tokenizer.load(config.model)
        pool = WorkerPool()
        first = asyncio.Event()

        async def follow() -> None:
            async for endpoints in discovery.watch():
                await pool.apply(endpoints)
                first.set()

        watcher = asyncio.create_task(follow())
        try:
            await asyncio.wait_for(first.wait(), timeout=10)
        except asyncio.TimeoutError:
            log.warning("discovery returned no workers within 10 s; serving anyway")
        await pool.wait_healthy(timeout_s=5.0)
        state.update(tokenizer=tok, pool=pool, flow=RequestFlow(config, tok, pool),
                     metrics=RouterMetrics())
        yield
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await pool.stop()

    app = FastAPI(title="Tandem router", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over Tandem's prefill and decode pools.")
    def decode_room(blocks: int) -> bool:
        """Some healthy decode worker reported at least this many free KV blocks (or has
        not reported yet). With no healthy decode worker at all, True: the request
        goes on and gets its 503 now instead of waiting in the queue."""
        decoders = state["pool"].healthy("decode")
        return not decoders or any(not w.load.total_blocks or w.load.free_blocks >= blocks
                                   for w in decoders)

    admission = Admission(config.max_inflight, config.max_queue, decode_room)
    request_log = open(config.log_requests, "a", buffering=1) if config.log_requests else None

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API key and body size, before any parsing."""
        if request.url.path.startswith("/v1/"):
            if config.api_key and not hmac.compare_digest(
                    request.headers.get("authorization", ""), f"Bearer {config.api_key}"):
                return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                "authentication_error").response(rid_of(request))
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
                return too_large(request, f"request body of {length} bytes")
            if length is None and request.method == "POST":  # chunked: count as it comes
                body = b""
                async for part in request.stream():
                    body += part
                    if len(body) > config.max_body_bytes:
                        return too_large(request, f"request body of over {len(body)} bytes")
                request._body = body  # the endpoint reads it from here (Starlette caches it)
        return await call_next(request)

    def too_large(request: Request, what: str) -> JSONResponse:
        return APIError(413, f"{what} exceeds the limit of {config.max_body_bytes} "
                             "(--max-body-bytes)").response(rid_of(request))

    def rid_of(request: Request) -> str:
        return request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if p != "body")
        return APIError(400, f"{field}: {err['msg']}", param=field).response(rid_of(request))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        pool: WorkerPool = state["pool"]
        ok = bool(pool.healthy("decode"))
        body = {"ready": ok, "prefill": len(pool.healthy("prefill")),
                "decode": len(pool.healthy("decode"))}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        m: RouterMetrics = state["metrics"]
        for role in ("prefill", "decode"):
            m.healthy.labels(role=role).set(len(state["pool"].healthy(role)))
        return PlainTextResponse(generate_latest(m.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "tandem"}]}

    def check_model(req) -> None:
        if req.model not in (None, "", model_name):
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{model_name!r}", param="model")

    def priority_of(request: Request, body_priority: int) -> int:
        header = request.headers.get("x-priority")
        if header is None:
            return body_priority
        try:
            return int(header)
        except ValueError:
            raise APIError(400, f"x-priority header must be an integer, got {header!r}",
                           param="x-priority") from None

    async def start(request: Request, body, prompt_ids: list[int], logprobs: int | None):
        """Validate and open the flow; returns (rid, deltas iterator, trace)."""
        check_model(body)
        tok: Tokenizer = state["tokenizer"]
        if not prompt_ids:
            raise APIError(400, "prompt is empty", param="prompt")
        bad = [t for t in prompt_ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary",
                           param="prompt")
        if len(prompt_ids) >= config.max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens; the context window is "
                                f"{config.max_model_len}", param="prompt")
        if body.max_tokens and len(prompt_ids) + body.max_tokens > config.max_model_len:
            raise APIError(400, f"max_tokens {body.max_tokens} + {len(prompt_ids)} prompt tokens "
                                f"exceed the context window of {config.max_model_len}",
                           param="max_tokens")
        try:
            params = body.sampling(config.default_max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        rid = rid_of(request)
        trace = Trace(rid)
        deltas = state["flow"].run(prompt_ids, params, priority_of(request, body.priority),
                                   rid, trace)
        return rid, deltas, trace

    async def first_or_error(deltas: AsyncIterator[Delta]) -> Delta:
        try:
            return await deltas.__anext__()
        except NoWorkerError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except WorkerError as e:
            status = _GRPC_TO_HTTP.get(e.code, 500)
            raise APIError(status, str(e), "invalid_request_error" if status < 500 else
                           "server_error") from e

    def account(trace: Trace, reason: str | None) -> None:
        m: RouterMetrics = state["metrics"]
        m.requests.labels(path=trace.path or "none", finish_reason=reason or "error").inc()
        m.prompt_tokens.inc(trace.prompt_tokens)
        m.generation_tokens.inc(trace.output_tokens)
        m.e2e.observe(trace.e2e_seconds)
        m.predicted_hits.inc(trace.predicted_cached_tokens)
        m.realized_hits.inc(trace.realized_cached_tokens)
        m.kv_bytes.inc(trace.bytes_pulled)
        m.queue_time.observe(trace.queue_seconds)
        line = trace.json()
        log.debug("trace %s", line)
        if request_log is not None:
            request_log.write(line + "\n")

    def deadline_of(request: Request) -> float:
        header = request.headers.get("x-request-timeout")
        timeout = config.request_timeout_s
        if header is not None:
            try:
                timeout = min(timeout, float(header))
            except ValueError:
                raise APIError(400, f"x-request-timeout must be seconds, got {header!r}",
                               param="x-request-timeout") from None
        return time.monotonic() + timeout

    async def respond(request: Request, body, prompt_ids: list[int], chat: bool,
                      logprobs: int | None):
        deadline = deadline_of(request)
        blocks = -(-(len(prompt_ids) + 1) // config.block_size)
        slot = admission.slot(priority_of(request, body.priority), deadline, blocks)
        try:
            queued = await slot.__aenter__()
        except QueueFull as e:
            err = APIError(429, str(e), "rate_limit_error").response(rid_of(request))
            err.headers["retry-after"] = str(e.retry_after_s)
            return err
        except DeadlineExceeded as e:
            raise APIError(504, str(e), "timeout_error") from e
        try:
            resp = await _respond(request, body, prompt_ids, chat, logprobs, queued)
        except BaseException:
            await slot.__aexit__(None, None, None)
            raise
        if isinstance(resp, StreamingResponse):  # the slot is held until the stream ends
            resp.background = BackgroundTask(slot.__aexit__, None, None, None)
        else:
            await slot.__aexit__(None, None, None)
        return resp

    async def _respond(request: Request, body, prompt_ids: list[int], chat: bool,
                       logprobs: int | None, queued: float):
        rid, deltas, trace = await start(request, body, prompt_ids, logprobs)
        trace.queue_seconds = queued
        m: RouterMetrics = state["metrics"]
        m.in_flight.inc()
        try:
            first = await first_or_error(deltas)
        except BaseException:
            m.in_flight.dec()
            raise
        m.ttft.observe(trace.ttft_seconds)
        created = int(time.time())
        headers = {"x-request-id": rid}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            lp = _LogprobFormat(state["tokenizer"], chat) if logprobs is not None else None
            gen = _sse(first, deltas, rid, created, model_name, chat, usage, trace, m, account, lp)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        task = asyncio.ensure_future(_collect(first, deltas, m))
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await deltas.aclose()
                m.in_flight.dec()
                account(trace, "abort")
                return JSONResponse({}, status_code=499)
        m.in_flight.dec()
        text, reason, ids, lps = task.result()
        account(trace, reason)
        lp = (_LogprobFormat(state["tokenizer"], chat).render(ids, lps)
              if logprobs is not None else None)
        return JSONResponse(_full_body(rid, created, model_name, chat, text, reason, trace, lp),
                            headers=headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            tok: Tokenizer = state["tokenizer"]
            ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
            return await respond(request, body, ids, chat=False, logprobs=body.logprobs)
        except APIError as e:
            return e.response(rid_of(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            tok: Tokenizer = state["tokenizer"]
            if body.max_completion_tokens and not body.max_tokens:
                body.max_tokens = body.max_completion_tokens
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from e
            ids = tok.encode(text, add_special_tokens=False)
            lp = (body.top_logprobs or 0) if body.logprobs else None
            return await respond(request, body, ids, chat=True, logprobs=lp)
        except APIError as e:
            return e.response(rid_of(request))

    return app


async def _collect(first: Delta, deltas: AsyncIterator[Delta], m: RouterMetrics):
    parts, reason = [first.text], first.finish_reason
    ids, lps = list(first.token_ids), list(first.logprobs)
    if not first.finished:
        async for d in deltas:
            parts.append(d.text)
            ids.extend(d.token_ids)
            lps.extend(d.logprobs)
            if d.finished:
                reason = d.finish_reason
    return "".join(parts), reason, ids, lps


class _LogprobFormat:
    """OpenAI logprobs objects: chat (content list, top_logprobs entries) or
    completions (tokens, token_logprobs, top_logprobs dicts, text_offset)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat

    def _tok(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render(self, ids: list[int], lps: list[Logprob]) -> dict:
        pairs = list(zip(ids, lps))
        tokens = [self._tok(t) for t, _ in pairs]
        if self.chat:
            return {"content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                 "top_logprobs": [{"token": (alt := self._tok(t)), "logprob": alp,
                                   "bytes": list(alt.encode())} for t, alp in top]}
                for tok, (_, (lp, top)) in zip(tokens, pairs)]}
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in pairs],
                "top_logprobs": [{self._tok(t): alp for t, alp in top} if top else None
                                 for _, (_, top) in pairs],
                "text_offset": offsets}


def _usage(trace: Trace) -> dict:
    return {"prompt_tokens": trace.prompt_tokens, "completion_tokens": trace.output_tokens,
            "total_tokens": trace.prompt_tokens + trace.output_tokens,
            "prompt_tokens_details": {"cached_tokens": trace.realized_cached_tokens}}


def _full_body(rid, created, model, chat, text, reason, trace, lp) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": lp, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(trace)}


async def _sse(first: Delta, deltas: AsyncIterator[Delta], rid, created, model, chat: bool,
               include_usage: bool, trace: Trace, m: RouterMetrics, account,
               lp: _LogprobFormat | None = None):
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": created, "model": model}

    def chunk(text: str | None, reason: str | None, role: bool = False, d: Delta | None = None
              ) -> str:
        lps = lp.render(d.token_ids, d.logprobs) if lp is not None and d is not None else None
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": reason}
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    reason = None
    last = time.monotonic()
    try:
        if chat:
            yield chunk(None, None, role=True)
        d = first
        while True:
            if d.text or (lp is not None and d.token_ids):
                yield chunk(d.text, None, d=d)
            if d.finished:
                reason = d.finish_reason
                break
            d = await deltas.__anext__()
            now = time.monotonic()
            m.itl.observe(now - last)
            last = now
        yield chunk(None if chat else "", reason)
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(trace)})}\n\n"
        yield "data: [DONE]\n\n"
    except (StopAsyncIteration, NoWorkerError, WorkerError) as e:
        reason = "error"
        err = {"error": {"message": str(e) or "stream ended early", "type": "server_error",
                         "param": None, "code": None}}
        yield f"data: {json.dumps(err)}\n\n"
    finally:
        await deltas.aclose()
        m.in_flight.dec()
        account(trace, reason or "abort")
