"""OpenAI error objects ({"error": {message, type, param, code}}) with the matching
HTTP status, and how worker failures map onto them."""
from __future__ import annotations

from typing import Mapping, Sequence

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from core.errors import FieldError
from router.outcomes import DeadlineExceeded, NoWorkerError, QueueFull, WorkerError

_GRPC_TO_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                 grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})
"""pydantic's names of a union's branches in an error's location (prompt.str), not fields."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None}}

    def response(self, headers: dict[str, str]) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers={**headers, **self.headers})

    @classmethod
    def from_flow(cls, e: Exception) -> APIError:
        """The HTTP error for a failure of the request's flow through the workers."""
        if isinstance(e, QueueFull):
            return cls(429, str(e), "rate_limit_error",
                       headers={"retry-after": str(e.retry_after_s)})
        if isinstance(e, NoWorkerError):
            return cls(503, str(e), "service_unavailable")
        if isinstance(e, DeadlineExceeded):
            return cls(504, str(e), "timeout_error")
        if isinstance(e, WorkerError):
            status = _GRPC_TO_HTTP.get(e.code, 500)
            return cls(status, str(e), "invalid_request_error" if status < 500 else "server_error",
                       param=e.field)
        return cls(500, f"internal error: {type(e).__name__}", "server_error")

    def of_prompt(self, i: int) -> APIError:
        """This error as prompt i of a batch's: a prompt's own error names prompt[i]; any
        other field it names stays, and the message says which prompt."""
        param = f"prompt[{i}]" if self.param in (None, "prompt") else self.param
        message = self.message.removeprefix("prompt: ").removeprefix("prompt ")
        return APIError(self.status, f"prompt[{i}]: {message}", self.type, param, self.headers)

    @classmethod
    def invalid(cls, e: ValueError) -> APIError:
        """400 for a value the request may not carry, naming the field a FieldError
        carries (a plain ValueError names none)."""
        return cls(400, str(e), param=e.field if isinstance(e, FieldError) else None)

    @classmethod
    def from_validation(cls, exc: RequestValidationError) -> APIError:
        return cls.from_errors(exc.errors())

    @classmethod
    def from_errors(cls, errors: Sequence[Mapping]) -> APIError:
        """400 naming the first invalid field of pydantic's errors (body.messages.0.role
        -> messages.0.role; pydantic's union-branch tags are left out)."""
        err = errors[0]
        parts = [str(p) for p in err["loc"] if p != "body" and p not in _TYPE_TAGS
                 and (isinstance(p, int) or str(p).isidentifier())]
        field = ".".join(parts)
        return cls(400, f"{field}: {err['msg']}" if field else err["msg"], param=field or None)
