"""The router's HTTP edge as clients see it: OpenAI formats, errors, auth, limits,
admission, request ids, request logs and disconnects. Real worker and router
processes on the tiny model."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from tests.cluster.launch import cluster

TINY = ["--dtype", "float32", "--kv-blocks", "256"]


@pytest.fixture(scope="module")
def c(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    with cluster(tiny_model_dir, "tcp", worker_args=TINY,
                 router_args=["--local-prefill-threshold", "8", "--log-requests", str(log),
                              "--max-body-bytes", "4096"]) as cl:
        cl.request_log = log
        yield cl


def post(c, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(c.url + path, json=body, timeout=60, **kw)


def test_completion_non_streaming(c) -> None:
    r = post(c, "/v1/completions", {"prompt": "hello world, this is long enough to prefill",
                                    "max_tokens": 5, "temperature": 0, "ignore_eos": True},
             headers={"x-request-id": "my-id-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


def _sse(r: httpx.Response) -> list:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streaming_chunks_and_usage(c) -> None:
    with httpx.stream("POST", c.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        ev = _sse(r)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])
    finals = [e for e in ev[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 6
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-2] if e["choices"])
    full = post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                                            "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert full.json()["choices"][0]["message"]["content"] == text


def test_stop_string_cuts_text(c) -> None:
    base = {"prompt": "abcdefghij klmnop", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(c, "/v1/completions", base).json()["choices"][0]["text"]
    assert len(text) >= 4
    stop = text[2:4]
    r = post(c, "/v1/completions", {**base, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == text[: text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 9}, 400, "temperature"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "", "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [1, 99999], "max_tokens": 2}, 400, "prompt"),
    ({"messages": []}, 400, "messages"),
])
def test_errors_are_openai_objects(c, body, status, param) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(c, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert r.headers.get("x-request-id")


def test_body_size_limit(c) -> None:
    r = post(c, "/v1/completions", {"prompt": "x" * 10000})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


def test_body_size_limit_holds_for_chunked_bodies(c) -> None:
    """No Content-Length (Transfer-Encoding: chunked): counted as it arrives."""
    def body(prompt: str):
        yield json.dumps({"prompt": prompt, "max_tokens": 2, "ignore_eos": True}).encode()

    headers = {"content-type": "application/json"}
    r = httpx.post(c.url + "/v1/completions", content=body("x" * 10000), headers=headers,
                   timeout=60)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    r = httpx.post(c.url + "/v1/completions", content=body("a small chunked prompt here"),
                   headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_models_health_ready_metrics_openapi(c) -> None:
    models = httpx.get(c.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert httpx.get(c.url + "/health").json() == {"status": "ok"}
    assert httpx.get(c.url + "/ready").json()["ready"] is True
    m = httpx.get(c.url + "/metrics").text
    for name in ("tandem:time_to_first_token_seconds", "tandem:e2e_request_latency_seconds",
                 "tandem:inter_token_latency_seconds", "tandem:request_queue_time_seconds",
                 "tandem:router_requests_total", "tandem:prefix_cache_hits_predicted_total"):
        assert name in m
    spec = httpx.get(c.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "priority", "stream_options"} <= set(props)


def test_request_log_lines(c) -> None:
    post(c, "/v1/completions", {"prompt": "log me please, a long enough prompt here",
                                "max_tokens": 3, "ignore_eos": True},
         headers={"x-request-id": "logged-1"})
    for _ in range(50):
        lines = [json.loads(x) for x in c.request_log.read_text().splitlines()]
        hit = [x for x in lines if x["client_request_id"] == "logged-1"]
        if hit:
            break
        time.sleep(0.05)
    t = hit[0]
    assert t["path"] == "disaggregated" and t["prefill_worker"] and t["decode_worker"]
    assert t["output_tokens"] == 3 and t["bytes_pulled"] > 0


def test_usage_reports_cached_prompt_tokens(c) -> None:
    """usage.prompt_tokens_details.cached_tokens: what the prefilling worker served from
    its prefix cache (the second send of a 3-block prompt finds at least 2 blocks), on
    the disaggregated path and on the local one (decode worker prefills)."""
    prompt = list(range(5, 5 + 50))  # token ids: 3 full blocks + 2 tokens
    for _ in range(2):
        r = post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32 and cached % 16 == 0
    assert r.json()["usage"]["prompt_tokens"] == 50


def test_disconnect_aborts_on_every_worker(c) -> None:
    with httpx.stream("POST", c.url + "/v1/completions", timeout=60, json={
            "prompt": "a long story about everything that ever happened", "max_tokens": 200,
            "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    c.leak_check()
    assert c.load(c.decode[0]).num_running == 0


def test_queue_full_is_429_with_retry_after(tiny_model_dir) -> None:
    with cluster(tiny_model_dir, "tcp", worker_args=TINY,
                 router_args=["--max-inflight", "1", "--max-queue", "1", "--api-key", "s3cret"]) as c:
        hdr = {"authorization": "Bearer s3cret"}
        assert post(c, "/v1/completions", {"prompt": "x"}).status_code == 401
        assert post(c, "/v1/completions", {"prompt": "x"},
                    headers={"authorization": "Bearer nope"}).status_code == 401
        body = {"prompt": "count to a thousand slowly", "max_tokens": 150, "ignore_eos": True}
        with cf.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(post, c, "/v1/completions", body, headers=hdr) for _ in range(4)]
            rs = [f.result() for f in futs]
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 429 in codes, codes
        busy = next(r for r in rs if r.status_code == 429)
        assert int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        c.leak_check()
