"""The HTTP edge: OpenAI-compatible endpoints (router/http/endpoints.py) behind the
edge guard (router/http/middleware.py), over the router's shared state."""
from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from engine.tokenizer import Tokenizer
from router.admission import Admission
from router.config import RouterConfig
from router.flow import RequestFlow
from router.http.endpoints import Endpoints
from router.http.errors import APIError
from router.http.middleware import EdgeGuard
from router.metrics import RouterMetrics
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.state import RouterState
from router.workers import WorkerPool

log = logging.getLogger(__name__)
DISCOVERY_WAIT_S = 10.0


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    discovery = config.make_discovery()  # config errors surface before serving

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool = WorkerPool()
        first = asyncio.Event()

        async def follow() -> None:
            async for endpoints in discovery.watch():
                await pool.apply(endpoints)
                first.set()

        watcher = asyncio.create_task(follow())
        try:
            await asyncio.wait_for(first.wait(), timeout=DISCOVERY_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("discovery returned no workers within %.0f s; serving anyway",
                        DISCOVERY_WAIT_S)
        await pool.wait_healthy(timeout_s=5.0)
        app.state.router = _state(config, tokenizer, pool)
        yield
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await pool.stop()

    app = FastAPI(title="Tandem router", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over Tandem's prefill and decode pools.")
    app.add_middleware(EdgeGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    def ep(request: Request) -> Endpoints:
        return Endpoints(request.app.state.router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        rid = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        return APIError.from_validation(exc).response({"x-request-id": rid})

    @app.get("/health")
    async def health(request: Request):
        return await ep(request).health()

    @app.get("/ready")
    async def ready(request: Request):
        return await ep(request).ready()

    @app.get("/metrics")
    async def metrics(request: Request):
        return await ep(request).metrics()

    @app.get("/v1/models")
    async def models(request: Request):
        return await ep(request).models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await ep(request).completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await ep(request).chat(body, request)

    return app


def _state(config: RouterConfig, tokenizer: Tokenizer | None, pool: WorkerPool) -> RouterState:
    tok = tokenizer or Tokenizer.load(config.model)
    return RouterState(
        config=config, model_name=config.model_name or Path(config.model).name.removesuffix(".gguf"),
        tokenizer=tok, pool=pool, flow=RequestFlow(config, tok, pool), metrics=RouterMetrics(),
        admission=Admission(config.max_inflight, config.max_queue, pool.has_decode_room),
        request_log=open(config.log_requests, "a", buffering=1) if config.log_requests else None)
