"""The router's spans, alone (fake workers, the SDK's in-memory exporter): one
request through the real app (edge guard, tracing middleware, endpoints, flow) with
a client traceparent, a decode worker that fails (a failover) and one that recomputes
(a KV fallback): span names, parent links, attributes and events."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from core.tokenizer import Tokenizer
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from router.flow import RequestFlow
from router.metrics import RouterMetrics
from router.spans import GENERATE, PREFILL
from router.state import RouterState
from router.workers import Worker
from tests.router.test_flow import FakeDecode, FakePool, FakePrefill, HandoffDecode

TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _app(model_dir, **config):
    cfg = RouterConfig(model=str(model_dir), decode=("127.0.0.1:1",), local_prefill_threshold=0,
                       routing="round_robin", **config)
    app = create_app(cfg)
    workers = [Worker("127.0.0.1:9100", "prefill", None, FakePrefill(), healthy=True),
               Worker("127.0.0.1:9101", "decode", None, FakeDecode(grpc.StatusCode.UNAVAILABLE),
                      healthy=True),
               Worker("127.0.0.1:9102", "decode", None, HandoffDecode(lease_ended=False),
                      healthy=True)]
    tok = Tokenizer.load(model_dir)
    pool = FakePool(workers)
    app.state.router = RouterState(cfg, "tiny", tok, pool, RequestFlow(cfg, tok, pool),
                                   RouterMetrics(), Admission(8, 8))
    return app


async def _post(app, stream: bool) -> httpx.Response:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        return await client.post("/v1/completions", json=body,
                                 headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
                                          "x-request-id": "client-7"})


def _usage(r: httpx.Response, stream: bool) -> dict:
    if not stream:
        return r.json()["usage"]
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return events[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_one_request_with_a_failover_is_one_trace_of_the_router(tiny_model_dir,
                                                                 span_exporter, stream) -> None:
    r = asyncio.run(_post(_app(tiny_model_dir), stream))
    assert r.status_code == 200, r.text
    assert _usage(r, stream)["completion_tokens"] == 4  # 4, then 4 again, 5, 6
    spans = span_exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v1/completions"
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN  # the client's span
    a = server.attributes
    assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/completions"
    assert a["tandem.request_id"].startswith("cmpl-")
    assert a["tandem.client_request_id"] == "client-7"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (4, 4)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert (a["tandem.path"], a["tandem.retries"], a["tandem.fallback"]) == (
        "disaggregated", 1, "unknown_peer")
    assert [(e.name, dict(e.attributes)) for e in server.events] == [
        ("tandem.retry", {"tandem.worker.role": "decode", "tandem.worker": "127.0.0.1:9101",
                          "tandem.reason": "UNAVAILABLE", "tandem.attempt": 0,
                          "tandem.generated_tokens": 1})]

    children = sorted((s for s in spans if s.parent.span_id == server.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == ["router.queue", PREFILL, GENERATE, PREFILL, GENERATE]
    assert len(spans) == 6  # nothing else, nothing nested deeper
    rid = a["tandem.request_id"]
    _, p0, d0, p1, d1 = children
    assert [s.attributes["tandem.worker_request_id"] for s in (p0, d0, p1, d1)] == [
        f"{rid}-0", f"{rid}-0", f"{rid}-1", f"{rid}-1"]
    assert all(s.kind is SpanKind.CLIENT for s in (p0, d0, p1, d1))
    assert (d0.attributes["tandem.worker"], d0.status.status_code) == ("127.0.0.1:9101",
                                                                       StatusCode.ERROR)
    assert (d1.attributes["tandem.worker"], d1.status.status_code) == ("127.0.0.1:9102",
                                                                       StatusCode.UNSET)
    assert [(e.name, dict(e.attributes)) for e in d1.events] == [
        ("tandem.kv_fallback", {"tandem.reason": "unknown_peer"})]
    assert p1.attributes["tandem.finished"] is False


def test_probes_and_refusals_at_the_edge_open_no_span(tiny_model_dir, span_exporter) -> None:
    """/health (polled by probes) is not traced, nor a request the edge guard refuses
    (no API key); one the handler refuses (a body without its prompt) is, with its 400."""
    async def body():
        app = _app(tiny_model_dir, api_key="k3y")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3})
            assert r.status_code == 401
            r = await client.post("/v1/completions", json={"max_tokens": 3},
                                  headers={"authorization": "Bearer k3y"})
            assert r.status_code == 400
    asyncio.run(body())
    (span,) = span_exporter.get_finished_spans()
    assert (span.name, span.attributes["http.response.status_code"]) == (
        "POST /v1/completions", 400)
