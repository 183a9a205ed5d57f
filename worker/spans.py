"""What the workers' spans say (docs/observability.md). tracing/rpc.py opens the
server span of each traced call; the services add to it here, once per request (never
per token), and open the decode side's phase spans:

    tandem.prefill.Prefill/Prefill (server)       prompt, cached tokens, prefill time
    tandem.decode.Decode/Generate (server)        tokens, finish reason; events:
      kv.reserve                                    a KV fallback, preemptions
      kv.pull                                     source, blocks, bytes, backend
        (on the source) tandem.kvlink.KVLink/Release (server)
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterator

from opentelemetry.trace import Span

from engine.request import Request, RequestOutput
from core.states import FallbackReason
from kvtransfer.base import SourceBlocks
from proto import decode_pb2, kv_link_pb2
from tracing import spans


def _end(out: RequestOutput) -> dict:
    return {"tandem.prompt_tokens": out.num_prompt_tokens,
            "tandem.cached_tokens": out.num_cached_tokens,
            "tandem.finish_reason": out.finish_reason.value if out.finish_reason else "handoff"}


def prefill_done(out: RequestOutput, seconds: float, handle: kv_link_pb2.KVHandle | None,
                 lora: str = "") -> None:
    """The Prefill span's figures (the current span); lora: the adapter's name ("": base)."""
    span = spans.current()
    if not span.is_recording():
        return
    attrs = {**_end(out), "tandem.request_id": out.request_id, "tandem.prefill_seconds": seconds,
             "tandem.lora": lora}
    if handle is not None:
        attrs.update({"tandem.lease_blocks": len(handle.block_ids),
                      "tandem.lease_epoch": handle.lease_epoch})
    span.set_attributes(attrs)


def generate_start(req: Request, kv_source: str) -> None:
    """The Generate span's request (the current span). kv_source: the prefill worker
    holding the prompt's KV, or "local" (this worker prefills)."""
    spans.annotate(spans.current(), {
        "tandem.request_id": req.request_id, "tandem.priority": req.priority,
        "tandem.context_tokens": len(req.token_ids), "tandem.kv_source": kv_source,
        "tandem.lora": req.lora.name if req.lora is not None else ""})


def generate_done(out: RequestOutput) -> None:
    """The Generate span's end (the current span): output tokens, finish reason; a
    request that was preempted gets an event saying how often and for how long."""
    span = spans.current()
    if not span.is_recording():
        return
    span.set_attributes({**_end(out), "tandem.output_tokens": out.num_output_tokens})
    if out.num_preemptions:
        span.add_event("tandem.preempted", {"tandem.preemptions": out.num_preemptions,
                                            "tandem.preempted_seconds": out.preempted_seconds})


@contextmanager
def reserving(req: Request, num_kv_tokens: int) -> Iterator[Span]:
    """The wait for KV room (in priority order, preempting when allowed)."""
    with spans.phase("kv.reserve", {"tandem.kv_tokens": num_kv_tokens,
                                    "tandem.priority": req.priority}) as span:
        yield span


def fallback(reason: FallbackReason) -> None:
    """The decode worker recomputes the prompt instead of pulling it: an event on the
    current span (the pull's, or the request's when no pull started)."""
    spans.event("tandem.kv_fallback", {"tandem.reason": reason.value})


def pull_span(pull: Callable[..., Awaitable[bool]]) -> Callable[..., Awaitable[bool]]:
    """Decorates DecodeService._pull(handle, peer, res, trace): the pull runs in its
    span (so the Release it sends carries it), which ends with the trace's figures."""
    @functools.wraps(pull)
    async def traced(self, handle: SourceBlocks, peer, res, trace: decode_pb2.KVTrace) -> bool:
        with spans.phase("kv.pull", {"tandem.kv_source": handle.worker_id,
                                     "server.address": handle.endpoint,
                                     "tandem.blocks": len(res.fill)}) as span:
            ok = await pull(self, handle, peer, res, trace)
            spans.annotate(span, {"tandem.ok": ok, "tandem.blocks_pulled": trace.blocks_pulled,
                                  "tandem.bytes_pulled": trace.bytes_pulled,
                                  "tandem.transfer_seconds": trace.transfer_seconds,
                                  "tandem.backend": trace.backend or "",
                                  "tandem.lease_ended": trace.lease_ended})
            return ok
    return traced
