"""The router's server span for each API request: a plain ASGI middleware, put inside
the edge guard (router/http/middleware.py), so a request the guard refuses (no key,
over its rate or body limit) opens no span, the guard stays the only reader of the
connection, and a client that goes away cancels the handler through this span (which
then ends as cancelled). A ``traceparent`` from the client is honoured: the span is
its child. Paths outside ``prefixes`` (/health, /ready, /metrics: probes and
scrapers, every few seconds) are not traced.

The handlers below set the request's own attributes on the current span (tokens,
finish reason, ids); this middleware sets the HTTP ones: method, route, status.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from opentelemetry.trace import SpanKind, Status, StatusCode

from tracing.provider import tracer
from tracing.rpc import extract

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HTTPSpans:
    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = ("/v1/",)) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            return await self.app(scope, receive, send)
        parent = extract((k.decode("latin-1"), v.decode("latin-1"))
                         for k, v in scope.get("headers") or ())
        method = scope["method"]
        with tracer().start_as_current_span(
                method, context=parent, kind=SpanKind.SERVER, record_exception=False,
                set_status_on_exception=False,
                attributes={"http.request.method": method, "url.path": scope["path"],
                            "url.scheme": scope.get("scheme", "http")}) as span:
            async def send_status(msg: Message) -> None:
                if msg["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", msg["status"])
                    if msg["status"] >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(msg)

            try:
                await self.app(scope, receive, send_status)
            except asyncio.CancelledError:
                span.set_status(Status(StatusCode.ERROR, "cancelled: the client went away"))
                raise
            except BaseException as e:
                span.record_exception(e)
                span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
                raise
            finally:
                route = getattr(scope.get("route"), "path", None)  # set by the router
                if route:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
