"""The router's HTTP server and edge guard (router/http/server.py, middleware.py) around a
toy app, on real sockets: a client that stops reading a stream has its request ended,
what it held freed, and its connection closed after --write-timeout-s."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from auth.keys import KeyRing
from router.http.middleware import EdgeGuard
from router.http.server import protocol_class

CHUNK = b"x" * 65536
WRITE_TIMEOUT_S = 1.0


class _Streamer:
    """An app that streams without end and says when its cleanup ran."""

    def __init__(self) -> None:
        self.sent = 0
        self.cleaned = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        await receive()  # the (empty) body
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            while True:
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
                self.sent += len(CHUNK)
                await asyncio.sleep(0)
        finally:
            self.cleaned.set()  # what a handler holds (an admission slot, a flow) goes here


def _serve(app) -> tuple[uvicorn.Server, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    guard = EdgeGuard(app, KeyRing(None, ()), None, 1 << 20, frozenset({"/stream"}),
                      frozenset(), read_timeout_s=5.0, write_timeout_s=WRITE_TIMEOUT_S)
    server = uvicorn.Server(uvicorn.Config(guard, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", http=protocol_class(64, 5.0)))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return server, port


def test_a_client_that_stops_reading_is_dropped_and_its_request_freed() -> None:
    """Before, a write to a client that did not read waited forever, and the request kept
    everything it held (its admission slot, its workers' blocks)."""
    app = _Streamer()
    server, port = _serve(app)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        assert app.cleaned.wait(timeout=60), f"still streaming after {app.sent} bytes"
        assert app.sent > 0
        s.settimeout(30)
        received = 0
        try:  # what was buffered, then the end of the connection
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert 0 < received <= app.sent + len(CHUNK)
        s.close()
    finally:
        server.should_exit = True
