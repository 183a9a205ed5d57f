"""Spans and events as Tandem's services open them: a phase of a request (current
inside its block, so the calls made in it carry its traceparent), a span kept out of
the context (for async generators), and events. Per request and per phase only,
never per token: with tracing off each is the API's no-op span."""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence, Union

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tracing.provider import tracer

AttributeValue = Union[str, bool, int, float, Sequence[str]]
Attributes = Mapping[str, AttributeValue]
CLIENT, SERVER, INTERNAL = SpanKind.CLIENT, SpanKind.SERVER, SpanKind.INTERNAL


def current() -> Span:
    """The span current in this context (the API's invalid span when none)."""
    return trace.get_current_span()


@contextmanager
def phase(name: str, attributes: Attributes | None = None,
          kind: SpanKind = INTERNAL) -> Iterator[Span]:
    """A span, current inside the block. Only for a block that does not yield (in a
    coroutine, or between two yields of an async generator: see ``detached``). An
    exception, a cancellation included, ends it with an error status."""
    with tracer().start_as_current_span(name, kind=kind, attributes=attributes) as span:
        yield span


@contextmanager
def detached(name: str, attributes: Attributes | None = None,
             kind: SpanKind = CLIENT) -> Iterator[Span]:
    """A span that is not made current, for a block of an async generator that yields:
    the generator runs in the context of whoever resumes it, so a span attached across
    a yield would leak into that caller, and its detach might run in another task's
    context. Make it current only around the call that should carry it (``calling``).
    Ended on exit: with an error status on an exception, "cancelled" when the block is
    cancelled or its generator closed. A generator that may never be resumed after its
    last yield (its consumer stops at the item that says "finished") ends the span
    itself before that yield (span.end()); the exit then leaves it as it is."""
    span = tracer().start_span(name, kind=kind, attributes=attributes)
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
        raise
    except BaseException as e:
        if span.is_recording():
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        if span.is_recording():
            span.end()


@contextmanager
def calling(span: Span) -> Iterator[None]:
    """span current while a gRPC call is started: the call's interceptors take its
    traceparent then (grpc.aio copies the context when the call is made)."""
    with trace.use_span(span, end_on_exit=False, record_exception=False,
                        set_status_on_exception=False):
        yield


def annotate(span: Span, attributes: Attributes) -> None:
    """Set attributes on span (nothing when it does not record)."""
    if span.is_recording():
        span.set_attributes(attributes)


def event(name: str, attributes: Attributes | None = None, span: Span | None = None) -> None:
    """An event on span (default: the current one): a fallback, a retry, a preemption."""
    (span or current()).add_event(name, attributes or {})
