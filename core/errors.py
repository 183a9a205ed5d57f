"""Errors a client caused, carrying the request field they are about. Torch-free: the
router raises and reads them too.

The field travels as data, never inside the message: the router turns it into the HTTP
error's ``param`` (router/http/errors.py) and the workers into the field violation of
their INVALID_ARGUMENT status (worker/base.py), so nobody recovers it by splitting text.
"""
from __future__ import annotations


class FieldError(ValueError):
    """A request field holds a value this server refuses. ``str()`` is the message as the
    client reads it (it usually names the field itself); ``field`` is the field's path
    in the request, dotted (``guided.text``, ``tools.0.function.name``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
