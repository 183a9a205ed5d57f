"""The HTTP edge: OpenAI-compatible routes (router/http/) behind the edge guard, over
the router's state (router/state.py)."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from auth.keys import KeyRing, load_admin_key, load_metrics_key
from auth.secret import load_cluster_secret
from core.tokenizer import Tokenizer
from router.config import RouterConfig
from router.http.middleware import EdgeGuard
from router.http.routes import BODY_MODELS, invalid_request, routes
from router.state import running_state
from tracing import provider as tracing
from tracing.http import HTTPSpans


def create_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    # every configuration error surfaces here, before serving
    discovery = config.make_discovery()
    secret = load_cluster_secret(config.cluster_secret_file)
    keys = KeyRing.from_config(config.api_keys_file, config.api_key)
    metrics_key = load_metrics_key(config.metrics_key_file)
    admin_key = load_admin_key(config.admin_key_file)

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
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(routes)
    fastapi_openapi = app.openapi
    app.openapi = lambda: _with_bodies(app, fastapi_openapi)
    served = _routes(app)
    app.add_middleware(EdgeGuard, keys=keys, metrics_key=metrics_key,
                       max_body_bytes=config.max_body_bytes,
                       paths=frozenset(r.path for r in served),
                       body_routes=frozenset(("POST", r.path) for r in served
                                             if "POST" in (r.methods or ())),
                       read_timeout_s=config.read_timeout_s,
                       write_timeout_s=config.write_timeout_s, admin_key=admin_key)
    return app


def _routes(app: FastAPI) -> list:
    """Every route the app serves, those of included routers too."""
    out = []
    for r in app.routes:
        included = getattr(r, "original_router", None)
        out += included.routes if included is not None else [r]
    return out


def _with_bodies(app: FastAPI, fastapi_openapi: Callable[[], dict]) -> dict:
    """FastAPI's document, plus the request bodies the endpoints parse themselves."""
    if app.openapi_schema is None:
        doc = fastapi_openapi()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in BODY_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
    return app.openapi_schema
