"""What the router's spans say (docs/observability.md). The HTTP server span is
opened by tracing/http.py; here: the attributes a finished request leaves on it, the
client spans of the calls to the workers, and the events of a retry or a fallback.

Span tree of one request on the router:
    POST /v1/completions (server)
      router.queue                          waiting for an admission slot
      tandem.prefill.Prefill/Prefill        (client) one per prefill attempt
      tandem.decode.Decode/Generate         (client) one per decode attempt
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator, Mapping

from opentelemetry.trace import Span

from proto.convert import FALLBACK
from proto import decode_pb2, prefill_pb2
from router.workers import Worker
from tracing import spans
from tracing.spans import Attributes

PREFILL = "tandem.prefill.Prefill/Prefill"
GENERATE = "tandem.decode.Decode/Generate"


def _call(method: str, worker: Worker, wid: str) -> Attributes:
    service, _, name = method.rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name,
            "server.address": worker.address, "tandem.worker": worker.name,
            "tandem.worker_request_id": wid}


@contextmanager
def prefill_call(worker: Worker, wid: str) -> Iterator[Span]:
    """The client span of a Prefill call, current inside (no yield in the block)."""
    with spans.phase(PREFILL, _call(PREFILL, worker, wid), spans.CLIENT) as span:
        yield span


def prefill_reply(span: Span, first: prefill_pb2.PrefillResponse) -> None:
    spans.annotate(span, {"tandem.cached_tokens": first.num_cached_tokens,
                          "tandem.prefill_seconds": first.prefill_seconds,
                          "tandem.finished": first.finished})


def decode_call(worker: Worker, wid: str) -> ContextManager[Span]:
    """The client span of a Generate stream: not current (its block yields), so the
    call is started under ``tracing.spans.calling``."""
    return spans.detached(GENERATE, _call(GENERATE, worker, wid))


def decode_done(span: Span, last: decode_pb2.GenerateChunk) -> None:
    """The stream's last chunk arrived: the Generate span ends now (the flow may never
    resume the generator that holds it)."""
    spans.annotate(span, {"tandem.finish_reason": last.finish_reason,
                          "tandem.output_tokens": last.num_output_tokens})
    span.end()


def kv_trace(span: Span, t: decode_pb2.KVTrace) -> None:
    """The decode worker's KV trace (its first chunk) on the Generate span; a fallback
    (the worker recomputed the prompt) is an event."""
    spans.annotate(span, {"tandem.blocks_pulled": t.blocks_pulled,
                          "tandem.bytes_pulled": t.bytes_pulled,
                          "tandem.local_cached_tokens": t.local_cached_tokens,
                          "tandem.local_host_cached_tokens": t.local_host_cached_tokens,
                          "tandem.local_disk_cached_tokens": t.local_disk_cached_tokens,
                          "tandem.lease_ended": t.lease_ended})
    reason = FALLBACK.from_proto(t.fallback)
    if reason is not None:
        spans.event("tandem.kv_fallback", {"tandem.reason": reason.value}, span)


def retry(worker: Worker, reason: str, attempt: int, generated: int) -> None:
    """A worker failed and another takes the request over: an event on the request's
    span (current where the flow runs)."""
    spans.event("tandem.retry", {"tandem.worker.role": worker.role, "tandem.worker": worker.name,
                                 "tandem.reason": reason, "tandem.attempt": attempt,
                                 "tandem.generated_tokens": generated})


def finish_request(fields: Mapping[str, object], finish_reason: str) -> None:
    """A finished request's trace (router/trace.py Trace.fields) on the current
    span, the request's server span: every field as tandem.<field> (the --log-requests
    line's), the token counts and finish reason also under their gen_ai names."""
    span = spans.current()
    if not span.is_recording():
        return
    attrs = {f"tandem.{k}": v for k, v in fields.items()
             if isinstance(v, (str, int, float)) and v != ""}
    attrs.update({"gen_ai.usage.input_tokens": fields.get("prompt_tokens", 0),
                  "gen_ai.usage.output_tokens": fields.get("output_tokens", 0),
                  "gen_ai.response.finish_reasons": [finish_reason]})
    span.set_attributes(attrs)
