"""``--metrics-port``: the router's /metrics on a port of its own, so the API port carries
only the API (a NetworkPolicy can then admit clients on one port and scrapers on the
other).

One uvicorn server listens on both ports and serves one app (one router state, one
lifespan); ``split_metrics_port`` wraps it and routes each request by the local port
its connection came in on: /metrics only on the metrics port, everything else only on
the API port, a 404 naming the other port otherwise. The metrics key
(--metrics-key-file) is the edge guard's, checked wherever /metrics is served.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from starlette.responses import JSONResponse

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

METRICS_PATH = "/metrics"


def split_metrics_port(app: ASGIApp, metrics_port: int) -> ASGIApp:
    """``app`` served on two ports: /metrics on ``metrics_port`` only, the rest elsewhere."""
    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server") or (None, None)
            on_metrics_port = server[1] == metrics_port
            if (scope["path"] == METRICS_PATH) != on_metrics_port:
                message = (f"{METRICS_PATH} is served on the metrics port (--metrics-port)"
                           if not on_metrics_port else
                           f"this is the metrics port: only {METRICS_PATH} is served here")
                body = {"error": {"message": message, "type": "invalid_request_error",
                                  "param": None, "code": None}}
                return await JSONResponse(body, status_code=404)(scope, receive, send)
        await app(scope, receive, send)
    return routed
