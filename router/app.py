"""The HTTP edge: OpenAI-compatible routes (router/http/) behind the edge guard, over
the router's state (router/state.py)."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from auth.keys import KeyRing, load_metrics_key
from auth.secret import load_cluster_secret
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.http.middleware import EdgeGuard
from router.http.routes import invalid_request, routes
from router.state import running_state
from tracing import provider as tracing
from tracing.http import HTTPSpans


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    # every configuration error surfaces here, before serving
    discovery = config.make_discovery()
    secret = load_cluster_secret(config.cluster_secret_file)
    keys = KeyRing.from_config(config.api_keys_file, config.api_key)
    metrics_key = load_metrics_key(config.metrics_key_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with running_state(config, discovery, secret, tokenizer) as state:
            app.state.router = state
            yield

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tandem router", version="0.1.0", lifespan=lifespan, **docs,
                  description="OpenAI-compatible API over Tandem's prefill and decode pools.")
    if tracing.configure("tandem-router", config.otlp_traces_endpoint):
        app.add_middleware(HTTPSpans)  # added first, so it runs inside the edge guard
    app.add_middleware(EdgeGuard, keys=keys, metrics_key=metrics_key,
                       max_body_bytes=config.max_body_bytes)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(routes)
    return app
