"""The HTTP edge: OpenAI-compatible routes (router/http/) behind the edge guard, over
the router's state (router/state.py)."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.http.middleware import EdgeGuard
from router.http.routes import invalid_request, routes
from router.state import running_state


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    discovery = config.make_discovery()  # config errors surface before serving

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with running_state(config, discovery, tokenizer) as state:
            app.state.router = state
            yield

    app = FastAPI(title="Tandem router", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over Tandem's prefill and decode pools.")
    app.add_middleware(EdgeGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(routes)
    return app
