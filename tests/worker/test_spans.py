"""What the workers' spans say (worker/spans.py), recorded in memory: the Prefill and
Generate server spans' figures, a preemption and a KV fallback as events, and the
pull's span with the trace's figures."""
from __future__ import annotations

import asyncio

from engine.request import FinishReason, RequestOutput
from core.states import FallbackReason
from kvtransfer.base import SourceBlocks
from proto import decode_pb2, kv_link_pb2
from tracing import spans
from worker import spans as worker_spans


def test_the_request_spans_figures_and_events(span_exporter) -> None:
    out = RequestOutput("r-0", [7], "", True, FinishReason.LENGTH, num_prompt_tokens=20,
                        num_output_tokens=4, num_cached_tokens=16, num_preemptions=2,
                        preempted_seconds=0.5)
    with spans.phase("Generate"):
        worker_spans.fallback(FallbackReason.PEER_UNREACHABLE)
        worker_spans.generate_done(out)
    handoff = RequestOutput("r-0", [7], "", True, None, num_prompt_tokens=20)
    with spans.phase("Prefill"):
        worker_spans.prefill_done(handoff, 0.25, kv_link_pb2.KVHandle(block_ids=[3, 4],
                                                                      lease_epoch=9))
    gen, pre = span_exporter.get_finished_spans()
    assert [(e.name, dict(e.attributes)) for e in gen.events] == [
        ("tandem.kv_fallback", {"tandem.reason": "peer_unreachable"}),
        ("tandem.preempted", {"tandem.preemptions": 2, "tandem.preempted_seconds": 0.5})]
    assert dict(gen.attributes) == {"tandem.prompt_tokens": 20, "tandem.cached_tokens": 16,
                                    "tandem.finish_reason": "length", "tandem.output_tokens": 4}
    assert dict(pre.attributes) == {
        "tandem.prompt_tokens": 20, "tandem.cached_tokens": 0, "tandem.finish_reason": "handoff",
        "tandem.request_id": "r-0", "tandem.prefill_seconds": 0.25, "tandem.lease_blocks": 2,
        "tandem.lease_epoch": 9, "tandem.lora": ""}  # the base model (docs/observability.md)


class _Res:
    fill = [(0, 11), (1, 12)]


def test_a_pull_runs_in_its_span_and_ends_with_the_traces_figures(span_exporter) -> None:
    seen = []

    @worker_spans.pull_span
    async def pull(self, handle, peer, res, trace) -> bool:
        seen.append(spans.current().name)  # what a Release sent now would carry
        trace.blocks_pulled, trace.bytes_pulled, trace.backend = 2, 8192, "tcp"
        return True

    handle = SourceBlocks("prefill@h:1", "h:1", "r-0", 1, (5, 6), 0, 20)
    assert asyncio.run(pull(None, handle, None, _Res(), decode_pb2.KVTrace())) is True
    (span,) = span_exporter.get_finished_spans()
    assert seen == ["kv.pull"]
    assert dict(span.attributes) == {
        "tandem.kv_source": "prefill@h:1", "server.address": "h:1", "tandem.blocks": 2,
        "tandem.ok": True, "tandem.blocks_pulled": 2, "tandem.bytes_pulled": 8192,
        "tandem.transfer_seconds": 0.0, "tandem.backend": "tcp", "tandem.lease_ended": False}
