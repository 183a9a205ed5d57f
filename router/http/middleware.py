"""The edge guard: a plain ASGI middleware in front of every route.

1. Keys and body size, before any parsing: 401 without a valid API key on /v1 and
   the API docs (when keys are set), 429 with Retry-After past the key's rate limit,
   401 without the metrics key on /metrics (when one is set); the key found is put in
   the request's state (its priority ceiling applies in the endpoints). 413 for a body
   over --max-body-bytes, chunked or not (counted as it arrives).
2. A client that goes away cancels its request. The guard reads the body itself,
   replays it to the app, and from then on is the only reader of the connection:
   when the client disconnects before the response is complete, the handler's task
   is cancelled, streaming or not, so every handler frees what it holds (its
   admission slot, its workers' blocks and leases) through its own cleanup. Once
   the response is complete a disconnect means nothing.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
from typing import Awaitable, Callable

from auth.keys import KeyRing

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
                 headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": None}}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


KEYED_PREFIXES = ("/v1/", "/docs", "/redoc", "/openapi.json")


class EdgeGuard:
    def __init__(self, app: ASGIApp, keys: KeyRing, metrics_key: bytes | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self._metrics = b"Bearer " + metrics_key if metrics_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not await self._admit(scope, send):
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        await self._run(scope, receive, send, body)

    async def _admit(self, scope: Scope, send: Send) -> bool:
        """Check the keys this path needs; False when the guard answered instead."""
        path = scope["path"]
        presented = _header(scope, b"authorization") or b""  # bytes: any header is comparable
        if path == "/metrics" and self._metrics is not None:
            if not hmac.compare_digest(presented, self._metrics):
                await _error(send, 401, "invalid or missing metrics key (Authorization: Bearer "
                                        "...; --metrics-key-file)", "authentication_error")
                return False
        if not path.startswith(KEYED_PREFIXES) or not self.keys.enabled:
            return True
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
        return True

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when the guard answered (413) or the client left."""
        limit = self.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _error(send, 413, f"request body of {int(length)} bytes exceeds the limit "
                                    f"of {limit} (--max-body-bytes)", "invalid_request_error")
            return None
        parts, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _error(send, 413, f"request body of over {limit} bytes exceeds the "
                                        f"limit of {limit} (--max-body-bytes)",
                             "invalid_request_error")
                return None
            parts.append(chunk)
            more = msg.get("more_body", False)
        return b"".join(parts)

    async def _run(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        gone = asyncio.Event()
        complete = False
        replayed = False

        async def app_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(msg: Message) -> None:
            nonlocal complete
            await send(msg)
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
        finally:
            listener.cancel()
