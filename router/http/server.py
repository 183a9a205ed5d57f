"""The router's HTTP server: uvicorn, with the connection-level limits it lacks.

uvicorn bounds neither how many connections it holds nor how long a client may take to
send a request's head, so a client that opens connections and trickles bytes (or
none) holds them forever. Its own ``limit_concurrency`` answers 503 only once a head
has arrived. Here, on the connection itself:

- ``--max-connections``: a connection beyond it is answered at once, 429 with
  Retry-After, and closed (before any byte of its request is read);
- ``--read-timeout-s``: a connection must deliver each request's head within it (from
  the connection's start, or from a request's first byte); else 408 and closed. The
  body's deadline is the edge guard's (middleware.py), which can name the flag in an
  OpenAI error object. An idle keep-alive connection is closed by uvicorn's own
  keep-alive timeout.

The protocol also puts ``tandem.close`` (closes this connection) in each request's
scope, so the edge guard can drop a client that stops reading its stream without
uvicorn reporting the unfinished response as an application error.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from router.config import RouterConfig

log = logging.getLogger("tandem")
CLOSE_KEY = "tandem.close"
REFUSED_LINGER_S = 1.0
"""How long a refused connection stays open after its answer (see LimitedHTTP._refuse)."""


def _raw_response(status: str, message: str, type_: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": None}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"{extra}content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class LimitedHTTP(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools or h11, as it picks) with the limits above;
    protocol_class() sets them."""

    max_connections = 1024
    read_timeout_s = 30.0
    _head_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(transport)
            return
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """429, then the end of our side; the socket closes a moment later, so the
        client's unread request does not turn our close into a reset that loses the
        answer."""
        self._refused = True
        transport.write(_raw_response(
            "429 Too Many Requests", f"the router holds {self.max_connections} connections "
            "already (--max-connections); retry later", "rate_limit_error",
            "retry-after: 1\r\n"))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's head arrived
            self._disarm()
            self.cycle.scope[CLOSE_KEY] = self.transport.close
        elif self._head_timer is None and (cycle is None or cycle.response_complete):
            self._arm()  # the first bytes of the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not (self.cycle is None
                                               or self.cycle.response_complete):
            return
        self.transport.write(_raw_response(
            "408 Request Timeout", f"no complete request head within {self.read_timeout_s:g} "
            "s (--read-timeout-s)", "invalid_request_error"))
        self.transport.close()


def protocol_class(max_connections: int, read_timeout_s: float) -> type[asyncio.Protocol]:
    return type("LimitedHTTP", (LimitedHTTP,), {"max_connections": max_connections,
                                                "read_timeout_s": read_timeout_s})


def serve(app, config: RouterConfig, log_level: str = "warning") -> None:
    """Serve the router's app until SIGINT/SIGTERM; with --metrics-port, /metrics on a
    port of its own (one server, two sockets: router/http/metrics_port.py)."""
    server = uvicorn.Config(app, host=config.host, port=config.port, loop="uvloop",
                            log_level=log_level.lower(), timeout_graceful_shutdown=5,
                            http=protocol_class(config.max_connections, config.read_timeout_s))
    sockets = [server.bind_socket()]
    if config.metrics_port is not None:
        from router.http.metrics_port import split_metrics_port

        sockets.append(_listen(config.host, config.metrics_port, "--metrics-port"))
        metrics_port = sockets[1].getsockname()[1]
        server.app = split_metrics_port(app, metrics_port)
        log.info("router metrics on http://%s:%d/metrics", config.host, metrics_port)
    uvicorn.Server(server).run(sockets=sockets)


def _listen(host: str, port: int, flag: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise RuntimeError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror})") from e
