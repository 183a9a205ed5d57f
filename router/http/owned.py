"""What a request's response owns: its outcome, and an SSE response that releases the
request's resources when the stream ends (router/http/endpoints.py, batch.py)."""
from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from router.outcomes import DeadlineExceeded, NoWorkerError, QueueFull, WorkerError
from router.trace import Trace

FLOW_ERRORS = (NoWorkerError, WorkerError, DeadlineExceeded, QueueFull)


@dataclass
class Outcome:
    trace: Trace
    reason: str = "abort"
    """How the request ended for the client; abort unless something else is known."""


class OwnedStream(StreamingResponse):
    """An SSE response that owns its request's resources: they are released when
    the stream ends, fails, or is cancelled because the client went away."""

    def __init__(self, content: AsyncIterator[str], stack: AsyncExitStack,
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._stack = stack

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._stack.aclose()




def echo_headers(request: Request, rid: str) -> dict[str, str]:
    """x-request-id: the client's, echoed; else the id the router minted."""
    return {"x-request-id": request.headers.get("x-request-id") or rid}
