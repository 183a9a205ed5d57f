"""W3C trace context over gRPC: a client interceptor puts the current span's
``traceparent`` (and ``tracestate``) in each call's metadata; a server interceptor
opens the server span under it for the handler, current while the handler runs.

Only W3C trace context travels (no baggage, whatever OTEL_PROPAGATORS says): these
values can come from an HTTP client, and gRPC refuses metadata over 8 KiB, so a
client's large baggage header must not be able to make every worker call fail.

A call is traced when it carries a valid traceparent or its method starts a request
(``root_methods``: Prefill, Generate), so the health checks, load polls and event
streams that run all the time open no span. Both interceptors exist only while
tracing is on (``client_interceptors``/``server_interceptors`` give none when off).
"""
from __future__ import annotations

import asyncio
import inspect
from contextlib import contextmanager
from typing import Iterable, Iterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tracing.provider import enabled, tracer

PROPAGATOR = TraceContextTextMapPropagator()
KEYS = frozenset(PROPAGATOR.fields)
"""traceparent, tracestate"""
MAX_TRACESTATE = 512
"""A longer tracestate is dropped (W3C: vendors keep at least 512 characters)."""


def inject() -> list[tuple[str, str]]:
    """Metadata carrying the current span's context (none without a valid span)."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    if len(carrier.get("tracestate", "")) > MAX_TRACESTATE:
        del carrier["tracestate"]
    return list(carrier.items())


def extract(pairs: Iterable[tuple[str, str]]):
    """The parent context in metadata (or HTTP headers): W3C trace context only."""
    carrier = {k.lower(): v for k, v in pairs if k.lower() in KEYS}
    if len(carrier.get("tracestate", "")) > MAX_TRACESTATE:
        del carrier["tracestate"]
    return PROPAGATOR.extract(carrier)


class _Inject:
    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        extra = inject()
        if not extra:
            return d
        return d._replace(metadata=grpc.aio.Metadata(*list(d.metadata or ()), *extra))


# grpc.aio files each interceptor under the first kind it is; Tandem's RPCs are all
# unary requests (one reply, or a stream of them)
class _UnaryUnary(_Inject, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Inject, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For a channel's interceptors: none while tracing is off."""
    return [_UnaryUnary(), _UnaryStream()] if enabled() else []


class ServerSpans(grpc.aio.ServerInterceptor):
    """Opens each traced call's server span, the handler's current span."""

    def __init__(self, root_methods: Iterable[str] = ()) -> None:
        self.root_methods = frozenset(root_methods)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        parent = extract(details.invocation_metadata or ())
        if (details.method not in self.root_methods
                and not trace.get_current_span(parent).get_span_context().is_valid):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _traced(handler.unary_unary, details.method, parent), **kw)
        return grpc.unary_stream_rpc_method_handler(
            _traced(handler.unary_stream, details.method, parent), **kw)


def server_interceptors(root_methods: Iterable[str] = ()) -> list[grpc.aio.ServerInterceptor]:
    """For a server's interceptors (after the auth check, so a refused call opens no
    span): none while tracing is off."""
    return [ServerSpans(root_methods)] if enabled() else []


def _traced(behavior, method: str, parent):
    """behavior run inside its server span (async generator or coroutine handler). The
    span may stay current across the generator's yields: grpc.aio runs a call's handler,
    and iterates its generator, in one task of its own."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            with _server_span(method, parent, context):
                async for item in behavior(request, context):
                    yield item
        return stream

    async def call(request, context):
        with _server_span(method, parent, context):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    return call


@contextmanager
def _server_span(method: str, parent, context) -> Iterator[None]:
    """The call's span, named service/method as the RPC conventions have it, with the
    status code the handler ended with."""
    service, _, name = method.lstrip("/").rpartition("/")
    with tracer().start_as_current_span(
            method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
            record_exception=False, set_status_on_exception=False,
            attributes={"rpc.system": "grpc", "rpc.service": service,
                        "rpc.method": name}) as span:
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            _status(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
            raise
        except BaseException as e:
            code = context.code()  # set when the handler aborted (AbortError)
            if code is None or code is grpc.StatusCode.OK:
                code = grpc.StatusCode.UNKNOWN
                span.record_exception(e)
            _status(span, code, context.details() or str(e))
            raise
        else:
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])


def _status(span, code: grpc.StatusCode, details) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
