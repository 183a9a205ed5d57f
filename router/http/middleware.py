"""The edge guard: a plain ASGI middleware in front of every route.

1. API key and body size, before any parsing: 401 without the key on /v1; 413 for
   a body over --max-body-bytes, chunked or not (counted as it arrives).
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
from typing import Awaitable, Callable

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


async def _error(send: Send, status: int, message: str, type_: str) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EdgeGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"].startswith("/v1/") and self._expected is not None:
            # bytes on both sides: a non-ASCII header is a mismatch, not a 500
            if not hmac.compare_digest(_header(scope, b"authorization") or b"", self._expected):
                return await _error(send, 401, "invalid or missing API key "
                                    "(Authorization: Bearer ...)", "authentication_error")
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        await self._run(scope, receive, send, body)

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
