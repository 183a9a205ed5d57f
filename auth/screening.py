"""Screening a gRPC request before its handler runs, from a server interceptor.

A grpc.aio server interceptor sees a call's method and metadata, not its body. The
body's bytes first reach the handler's ``request_deserializer``; ``screened`` wraps it
with a screen that returns the parsed message or a ``Refusal``, and wraps the handler
so that a Refusal is answered with its status and the handler never runs. Stacked
interceptors compose: an outer screen calls the inner one as its parser."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import grpc


@dataclass(frozen=True)
class Refusal:
    """What a screened request becomes instead of a message: the status to answer."""

    code: grpc.StatusCode
    message: str


Screen = Callable[[bytes], Any]
"""Request bytes -> the parsed message, or a Refusal."""


def screened(handler: grpc.RpcMethodHandler, screen: Screen) -> grpc.RpcMethodHandler:
    """``handler`` with ``screen`` as its request deserializer; a unary or unary-stream
    handler only (a client stream has no one message to screen)."""
    kw = dict(request_deserializer=screen, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream), **kw)
    raise ValueError("only a handler with one request message can be screened")


def refused(handler: grpc.RpcMethodHandler, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers ``refusal`` without parsing the request:
    a caller refused on its metadata learns nothing from its body."""
    async def unary(request, context):
        await context.abort(refusal.code, refusal.message)

    async def streaming(request, context):
        await context.abort(refusal.code, refusal.message)

    kw = dict(request_deserializer=lambda raw: None,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


def _guard(behavior):
    async def refuse(request: Refusal, context) -> None:
        await context.abort(request.code, request.message)

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, Refusal):
                await refuse(request, context)
            async for item in behavior(request, context):
                yield item
        return stream

    async def call(request, context):
        if isinstance(request, Refusal):
            return await refuse(request, context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result
    return call
