"""`tandem router --metrics-port`: /metrics on a port of its own (behind
--metrics-key-file there), and the API port then carries only the API."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from router.config import RouterConfig
from tandem.process import free_port, wait_http


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    key = tmp_path_factory.mktemp("metrics") / "metrics.key"
    key.write_text("scrape-0005\n")
    port, metrics_port, nobody = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "router", "--model", str(tiny_model_dir),
         "--port", str(port), "--metrics-port", str(metrics_port), "--metrics-key-file",
         str(key), "--decode", f"127.0.0.1:{nobody}"], start_new_session=True)
    api, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    try:
        wait_http(api + "/health", 120, "tandem router", proc)
        yield api, metrics
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_metrics_answer_only_on_the_metrics_port_and_only_with_the_key(router) -> None:
    api, metrics = router
    assert httpx.get(metrics + "/metrics", timeout=10).status_code == 401
    ok = httpx.get(metrics + "/metrics", timeout=10,
                   headers={"authorization": "Bearer scrape-0005"})
    assert ok.status_code == 200 and "tandem:router_requests_in_flight" in ok.text
    r = httpx.get(api + "/metrics", timeout=10, headers={"authorization": "Bearer scrape-0005"})
    assert r.status_code == 404 and "--metrics-port" in r.json()["error"]["message"]


def test_the_metrics_port_serves_nothing_else(router) -> None:
    api, metrics = router
    for path in ("/health", "/v1/models", "/docs"):
        r = httpx.get(metrics + path, timeout=10)
        assert r.status_code == 404 and "metrics port" in r.json()["error"]["message"], path
    r = httpx.post(metrics + "/v1/completions", timeout=10, json={"prompt": "x"})
    assert r.status_code == 404
    assert httpx.get(api + "/health", timeout=10).status_code == 200
    assert httpx.get(api + "/v1/models", timeout=10).json()["data"]


@pytest.mark.parametrize("port, metrics_port", [(8000, 8000), (8000, 70000), (8000, -1)])
def test_a_bad_metrics_port_is_refused_naming_the_flag(port, metrics_port) -> None:
    with pytest.raises(ValueError, match="--metrics-port"):
        RouterConfig(port=port, metrics_port=metrics_port)


def test_a_busy_metrics_port_is_a_clear_error(tiny_model_dir) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--model",
                            str(tiny_model_dir), "--port", str(free_port()), "--metrics-port",
                            str(port), "--decode", "127.0.0.1:1"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr
