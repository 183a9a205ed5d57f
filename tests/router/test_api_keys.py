"""Keys at the edge, through `tandem up` as a user runs it: TANDEM_API_KEY is passed
on to the router; a key file gives keys priority ceilings and rate limits; /metrics
takes its own key; the API docs can be turned off."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tandem.process import free_port, wait_http


@pytest.fixture(scope="module")
def up(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keys = d / "keys.yaml"
    keys.write_text("keys:\n"
                    "  - {key: sk-team-low-0001, name: low, priority_ceiling: 5}\n"
                    "  - {key: sk-team-slow-0002, name: slow, rate_limit_rps: 0.5, burst: 1}\n")
    (d / "metrics.key").write_text("scrape-0003\n")
    port = free_port()
    env = {**os.environ, "TANDEM_API_KEY": "k-from-env-0004"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model_dir), "--port",
         str(port), "--dtype", "float32", "--kv-blocks", "64", "--max-model-len", "256",
         f"--router-arg=--api-keys-file={keys}", f"--router-arg=--metrics-key-file={d}/metrics.key",
         "--router-arg=--no-docs"], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 240, "tandem up", proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _post(url: str, key: str | None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                      json={"prompt": "hello there", "max_tokens": 2, **body})


def test_tandem_up_passes_the_environment_key_on(up) -> None:
    assert _post(up, None).status_code == 401
    assert _post(up, "wrong-key").status_code == 401
    assert _post(up, "k-from-env-0004").status_code == 200
    assert httpx.get(up + "/v1/models", timeout=10).status_code == 401


def test_a_key_cannot_claim_more_priority_than_its_ceiling(up) -> None:
    r = _post(up, "sk-team-low-0001", priority=0)
    assert r.status_code == 403 and r.json()["error"]["param"] == "priority"
    assert r.json()["error"]["type"] == "permission_error"
    r = httpx.post(up + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2},
                   headers={"authorization": "Bearer sk-team-low-0001", "x-priority": "-3"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-priority"
    assert _post(up, "sk-team-low-0001", priority=5).status_code == 200
    assert _post(up, "sk-team-low-0001", priority=9).status_code == 200


def test_a_rate_limited_key_gets_429_with_retry_after(up) -> None:
    assert _post(up, "sk-team-slow-0002").status_code == 200
    r = _post(up, "sk-team-slow-0002")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    time.sleep(2.1)
    assert _post(up, "sk-team-slow-0002").status_code == 200


def test_metrics_key_and_no_docs(up) -> None:
    assert httpx.get(up + "/metrics", timeout=10).status_code == 401
    assert httpx.get(up + "/metrics", timeout=10,
                     headers={"authorization": "Bearer k-from-env-0004"}).status_code == 401
    ok = httpx.get(up + "/metrics", timeout=10, headers={"authorization": "Bearer scrape-0003"})
    assert ok.status_code == 200 and "tandem:router_requests_in_flight" in ok.text
    for path in ("/docs", "/openapi.json", "/redoc"):
        r = httpx.get(up + path, timeout=10, headers={"authorization": "Bearer k-from-env-0004"})
        assert r.status_code == 404, path
    assert httpx.get(up + "/health", timeout=10).status_code == 200  # probes stay open


def test_tokenize_and_detokenize_need_a_key(up) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [70]})):
        assert httpx.post(url := up + path, json=body, timeout=30).status_code == 401
        ok = httpx.post(url, json=body, timeout=30,
                        headers={"authorization": "Bearer k-from-env-0004"})
        assert ok.status_code == 200, ok.text


def test_a_stored_response_is_its_keys_only(up) -> None:
    def create(key: str, **body) -> httpx.Response:
        return httpx.post(up + "/v1/responses", timeout=60, json={
            "input": "hi", "max_output_tokens": 2, "priority": 5, **body},
            headers={"authorization": f"Bearer {key}"})
    first = create("k-from-env-0004")
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    assert create("k-from-env-0004", previous_response_id=rid).status_code == 200
    other = create("sk-team-low-0001", previous_response_id=rid)
    assert other.status_code == 400
    assert other.json()["error"]["param"] == "previous_response_id"
