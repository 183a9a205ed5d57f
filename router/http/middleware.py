"""The edge guard: a plain ASGI middleware in front of every route.

1. Keys, path and body size, before any byte of the body is read: 401 without a valid
   API key on /v1, /tokenize, /detokenize and the API docs (when keys are set), 429 with Retry-After past the
   key's rate limit, 401 without the metrics key on /metrics (when one is set), 401
   without the admin key on the LoRA admin paths (403 when no admin key is set); the key
   found is put in the request's state (its priority ceiling applies in the endpoints).
   404 for a path no route serves. Only the routes that take a body (``body_routes``)
   have it read: on any other, a body is never read and the connection is closed
   after the answer. 413 for a body over --max-body-bytes, chunked or not (counted as
   it arrives); 408 for one that does not arrive within --read-timeout-s.
2. A client that goes away cancels its request. The guard reads the body itself,
   replays it to the app (and lets go of it), and from then on is the only reader of
   the connection: when the client disconnects before the response is complete, the
   handler's task is cancelled, streaming or not, so every handler frees what it
   holds (its admission slot, its workers' blocks and leases) through its own
   cleanup. Once the response is complete a disconnect means nothing.
3. A client that stops reading is gone too: a write that waits on it for more than
   --write-timeout-s ends the request the same way and closes the connection.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Awaitable, Callable

from auth.keys import KeyRing

log = logging.getLogger(__name__)

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return v
    return None


async def _error(send: Send, status: int, message: str, type_: str,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": param,
                                 "code": None}}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


ADMIN_PATHS = frozenset(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
"""Paths that take the admin key (--admin-key-file) and no API key."""
KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return (length is not None and length not in (b"0", b"")) \
        or _header(scope, b"transfer-encoding") is not None


class EdgeGuard:
    def __init__(self, app: ASGIApp, keys: KeyRing, metrics_key: bytes | None,
                 max_body_bytes: int, paths: frozenset[str] = frozenset(),
                 body_routes: frozenset[tuple[str, str]] = frozenset(),
                 read_timeout_s: float = 30.0, write_timeout_s: float = 30.0,
                 admin_key: bytes | None = None) -> None:
        """paths: every path a route serves (empty: any); body_routes: the (method,
        path) pairs whose body is read; admin_key: what ADMIN_PATHS require (None: they
        are off, 403)."""
        self.app = app
        self.keys = keys
        self._metrics = b"Bearer " + metrics_key if metrics_key else None
        self._admin = b"Bearer " + admin_key if admin_key else None
        self.max_body_bytes = max_body_bytes
        self.paths, self.body_routes = paths, body_routes
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not await self._admit(scope, send):
            return
        if (scope["method"], scope["path"]) not in self.body_routes:
            return await self._run(scope, receive, send, b"", close=_has_body(scope))
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        await self._run(scope, receive, send, body)

    async def _admit(self, scope: Scope, send: Send) -> bool:
        """Check the keys this path needs, and that a route serves it; False when the
        guard answered instead."""
        path = scope["path"]
        presented = _header(scope, b"authorization") or b""  # bytes: any header is comparable
        if path == "/metrics" and self._metrics is not None:
            if not hmac.compare_digest(presented, self._metrics):
                await _error(send, 401, "invalid or missing metrics key (Authorization: Bearer "
                                        "...; --metrics-key-file)", "authentication_error")
                return False
        if path in ADMIN_PATHS:  # the admin key instead of an API key
            return await self._admin_key(presented, send)
        if path.startswith(KEYED_PREFIXES) and self.keys.enabled:
            key = self.keys.lookup(presented[7:]) if presented.startswith(b"Bearer ") else None
            if key is None:
                await _error(send, 401, "invalid or missing API key (Authorization: Bearer ...)",
                             "authentication_error")
                return False
            wait = key.take()
            if wait > 0:
                await _error(send, 429, f"API key {key.name!r} is over its rate limit of "
                                        f"{key.rate_limit_rps:g} requests/s; retry later",
                             "rate_limit_error", {"retry-after": str(max(1, math.ceil(wait)))})
                return False
            scope.setdefault("state", {})["api_key"] = key
        if self.paths and path not in self.paths:
            await _error(send, 404, f"no route {path}", "invalid_request_error",
                         {"connection": "close"} if _has_body(scope) else None)
            return False
        return True

    async def _admin_key(self, presented: bytes, send: Send) -> bool:
        """403 while run-time adapter changes are off, 401 without the admin key."""
        if self._admin is None:
            await _error(send, 403, "run-time LoRA adapter changes are off: start the router "
                                    "with --admin-key-file (or $TANDEM_ADMIN_KEY)",
                         "permission_error")
            return False
        if not hmac.compare_digest(presented, self._admin):
            await _error(send, 401, "invalid or missing admin key (Authorization: Bearer ...; "
                                    "--admin-key-file)", "authentication_error")
            return False
        return True

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when the guard answered (413, 408) or the client left."""
        limit = self.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _error(send, 413, f"request body of {int(length)} bytes exceeds the limit "
                                    f"of {limit} (--max-body-bytes)", "invalid_request_error",
                         {"connection": "close"})
            return None
        parts, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while more:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await _error(send, 413, f"request body of over {limit} bytes exceeds "
                                                f"the limit of {limit} (--max-body-bytes)",
                                     "invalid_request_error", {"connection": "close"})
                        return None
                    parts.append(chunk)
                    more = msg.get("more_body", False)
        except TimeoutError:
            await _error(send, 408, f"the request body did not arrive within "
                                    f"{self.read_timeout_s:g} s (--read-timeout-s)",
                         "invalid_request_error", {"connection": "close"})
            return None
        return b"".join(parts)

    async def _run(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                   close: bool = False) -> None:
        """Run the app on the body; close: a body that was not read is still on the
        connection, which therefore closes after the answer."""
        gone = asyncio.Event()
        complete = False
        replay = [body]  # let go of the body once the app has it

        async def app_receive() -> Message:
            if replay:
                return {"type": "http.request", "body": replay.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(msg: Message) -> None:
            nonlocal complete
            if close and msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
            try:
                await asyncio.wait_for(send(msg), self.write_timeout_s)
            except TimeoutError:
                self._stalled(scope, gone, task)
                raise
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                complete = True

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not complete:
                task.cancel()  # the client left mid-request: the handler cleans up

        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not gone.is_set():  # we ourselves are cancelled (server shutting down)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
        except Exception:  # noqa: BLE001 - the app failed writing to a client that stalled
            if not gone.is_set():
                raise
        finally:
            listener.cancel()

    def _stalled(self, scope: Scope, gone: asyncio.Event, task: asyncio.Future) -> None:
        """A client stopped reading: end its request as if it had hung up, and close
        the connection (server.py's protocol gives the means)."""
        log.warning("client %s stopped reading %s for %g s (--write-timeout-s); ending the "
                    "request and closing the connection", scope.get("client"), scope["path"],
                    self.write_timeout_s)
        gone.set()
        task.cancel()
        close = scope.get("tandem.close")
        if close is not None:
            close()
