"""How a request can fail on its way through the router (each maps to one HTTP status
in router/http/errors.py)."""
from __future__ import annotations

import grpc


class NoWorkerError(RuntimeError):
    """No healthy worker of a needed role (HTTP 503)."""


class WorkerError(RuntimeError):
    """A worker refused the request (its gRPC status maps to an HTTP code)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        """The request field the worker named (INVALID_ARGUMENT's status details)."""


class DeadlineExceeded(RuntimeError):
    """The request's deadline passed, queued or running (HTTP 504)."""


class QueueFull(RuntimeError):
    """The admission queue is full (HTTP 429 with Retry-After)."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the request queue is full ({waiting} waiting); retry later")
        self.retry_after_s = retry_after_s
