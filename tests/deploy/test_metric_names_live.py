"""Every metric name the HPAs, the adapter rules and the dashboard use is exported by
a running `tandem up` (its router and worker /metrics endpoints, read over HTTP)."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx

from tests.cluster.launch import free_port, interrupt
from tests.deploy.test_metric_names import autoscaled_chart, series_names, used_metric_names  # noqa: F401


def test_running_tandem_up_exports_every_used_name(tiny_model_dir, autoscaled_chart) -> None:  # noqa: F811
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model_dir), "--port",
         str(port), "--kv-transfer", "tcp", "--dtype", "float32", "--kv-blocks", "64"],
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        urls = [f"http://127.0.0.1:{port}/metrics"]
        deadline = time.monotonic() + 180
        while len(urls) < 3:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "tandem up exited"
            assert time.monotonic() < deadline, "tandem up not ready"
            m = re.search(r"metrics (http://\S+/metrics)", line)
            if m:
                urls.append(m.group(1))
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "a prompt that is long enough to go through prefill",
                             "max_tokens": 4})
        assert r.status_code == 200, r.text
        exported: set[str] = set()
        for url in urls:
            exported |= series_names(httpx.get(url, timeout=5).text)
        used = used_metric_names(autoscaled_chart)
        missing = {src: sorted(names - exported) for src, names in used.items() if names - exported}
        assert not missing, f"used but not exported by the running cluster: {missing}"
    finally:
        interrupt(proc)
    assert proc.returncode == 0
