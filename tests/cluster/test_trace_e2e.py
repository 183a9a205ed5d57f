"""One request is one trace across three processes: router, prefill worker and decode
worker (real processes on the tiny model, tests/cluster/launch.py) export their spans
over OTLP/HTTP to a receiver in the test, and the spans join: the client's trace id,
and parent links router -> prefill call -> Prefill, router -> decode call -> Generate
-> KV pull -> the source's Release."""
from __future__ import annotations

import httpx

from tests.cluster.launch import cluster
from tests.cluster.otlp import CLIENT, INTERNAL, SERVER, OTLPReceiver

TINY = ["--dtype", "float32", "--kv-blocks", "64", "--max-model-len", "256"]
TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PREFILL, GENERATE = "tandem.prefill.Prefill/Prefill", "tandem.decode.Decode/Generate"
HANDSHAKE, RELEASE = "tandem.kvlink.KVLink/Handshake", "tandem.kvlink.KVLink/Release"
ROUTER, P, D = "tandem-router", "tandem-prefill", "tandem-decode"
WANT = {(ROUTER, "POST /v1/completions"), (ROUTER, "router.queue"), (ROUTER, PREFILL),
        (ROUTER, GENERATE), (P, PREFILL), (D, GENERATE), (P, HANDSHAKE), (D, "kv.reserve"),
        (D, "kv.pull"), (P, RELEASE)}
"""Every span of the request: the decode worker's first pull from this source
handshakes first (later pulls reuse the link)."""


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_one_request_is_one_trace_across_three_processes(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s, not 5 s
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    prompt = [(j * 7) % 300 + 3 for j in range(20)]  # 2 KV blocks of 16
    with OTLPReceiver() as otlp, cluster(
            tiny_model_dir, "tcp", worker_args=TINY + ["--otlp-traces-endpoint", otlp.url],
            router_args=["--local-prefill-threshold", "0",
                         "--otlp-traces-endpoint", otlp.url]) as c:
        # generous: a first request may wait for the native kernels to build (engine/native.py)
        r = httpx.post(c.url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0},
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "cl-7"})
        assert r.status_code == 200, r.text
        spans = otlp.wait_for(TRACE_ID, WANT)
        pulled = _metric(c.metrics(c.decode[0]), "tandem:kv_transfer_bytes_total")
        c.leak_check()
    assert otlp.paths == {"/v1/traces"}  # the flag's bare URL got the traces path
    # each once, and no Abort: the request finished on its workers
    assert sorted((s.service, s.name) for s in spans) == sorted(WANT)
    one = {}
    for s in spans:
        assert (s.service, s.name, s.kind) not in one, f"two {s.name} spans in {s.service}"
        one[(s.service, s.name, s.kind)] = s
    server = one[(ROUTER, "POST /v1/completions", SERVER)]
    p_call, p_serve = one[(ROUTER, PREFILL, CLIENT)], one[(P, PREFILL, SERVER)]
    d_call, d_serve = one[(ROUTER, GENERATE, CLIENT)], one[(D, GENERATE, SERVER)]
    pull, release = one[(D, "kv.pull", INTERNAL)], one[(P, RELEASE, SERVER)]
    assert server.parent_id == CLIENT_SPAN
    assert (p_call.parent_id, p_serve.parent_id) == (server.span_id, p_call.span_id)
    assert (d_call.parent_id, d_serve.parent_id) == (server.span_id, d_call.span_id)
    assert (pull.parent_id, release.parent_id) == (d_serve.span_id, pull.span_id)
    assert one[(D, "kv.reserve", INTERNAL)].parent_id == d_serve.span_id
    assert one[(P, HANDSHAKE, SERVER)].parent_id == d_serve.span_id
    assert not any(s.error for s in spans), [s.name for s in spans if s.error]

    rid = server.attributes["tandem.request_id"]
    assert server.attributes["tandem.client_request_id"] == "cl-7"
    assert (server.attributes["gen_ai.usage.input_tokens"],
            server.attributes["gen_ai.usage.output_tokens"]) == (20, 4)
    assert server.attributes["http.response.status_code"] == 200
    assert p_serve.attributes["tandem.request_id"] == d_serve.attributes["tandem.request_id"] \
        == f"{rid}-0"
    assert (p_serve.attributes["tandem.prompt_tokens"], p_serve.attributes["tandem.cached_tokens"],
            p_serve.attributes["tandem.lease_blocks"]) == (20, 0, 2)
    assert (d_serve.attributes["tandem.output_tokens"],
            d_serve.attributes["tandem.finish_reason"]) == (4, "length")
    assert d_serve.attributes["tandem.kv_source"] == pull.attributes["tandem.kv_source"] \
        == f"prefill@{c.prefill[0].addr}"
    assert (pull.attributes["tandem.blocks_pulled"], pull.attributes["tandem.bytes_pulled"],
            pull.attributes["tandem.backend"], pull.attributes["tandem.ok"]) == (
        2, int(pulled), "tcp", True)
    assert pulled > 0
