"""Benchmark clients run unchanged against a Tandem router (the router tests' `api`
cluster: a prefill and a decode worker on the tiny model): guidellm's CLI runs one
short sweep with its defaults (chat completions, streamed, with vLLM's
continuous_usage_stats and ignore_eos), offline, its tokenizer loaded from the local
model directory; inference-perf (its own venv: it needs Python >= 3.12, the Makefile's
perf-venv makes it) runs a sweep of two constant-rate stages with its defaults
(completions, not streamed, its mock prompts). Every request completes with the token
counts asked for, and the cluster holds nothing afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
INFERENCE_PERF = Path(__file__).resolve().parents[2] / ".venv-perf" / "bin" / "inference-perf"


def _stream(api, path: str, body: dict) -> list[dict]:
    """The stream's events, [DONE] left off."""
    with httpx.stream("POST", api.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count on"}]}),
    ("/v1/completions", {"prompt": ["one", "two two"], "n": 2}),  # the batch path
])
def test_continuous_usage_stats_on_every_chunk(api, path, body) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far
    (what guidellm sends by default; a 400 naming the field before)."""
    events = _stream(api, path, {**body, "max_tokens": 5, "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True,
                                                    "continuous_usage_stats": True}})
    assert all("usage" in e for e in events)
    final = events[-1]["usage"]
    assert events[-1]["choices"] == [] and final["completion_tokens"] == 5 * (
        1 if "messages" in body else 4)
    by_prompt: dict[int, list[int]] = {}
    for e in events[:-1]:
        u = e["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        for c in e["choices"]:
            by_prompt.setdefault(c["index"] // body.get("n", 1), []).append(
                u["completion_tokens"])
    for seen in by_prompt.values():  # so far: never falls, ends at all of the prompt's
        assert seen == sorted(seen) and seen[-1] == 5 * body.get("n", 1)
    plain = _stream(api, path, {**body, "max_tokens": 2, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]
    api.leak_check()


def test_guidellm_sweep(api, tiny_model_dir, tmp_path) -> None:
    pytest.importorskip("guidellm", reason="guidellm is a test dependency (pyproject dev)")
    requests, out_tokens = 4, 8
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={api.url}",
           "--profile", "kind=sweep,sweep_size=3",  # synchronous, throughput, one rate
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={out_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}",
           "--output", f"kind=json,path={tmp_path / 'report.json'}",
           "--disable-console-interactive"]
    run = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **OFFLINE}, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(Path(tmp_path / "report.json").read_text())
    strategies = [b["config"]["strategy"]["type_"] for b in report["benchmarks"]]
    assert strategies == ["synchronous", "throughput", "constant"]
    for b in report["benchmarks"]:
        totals = b["metrics"]["request_totals"]
        assert totals == {"successful": requests, "errored": 0, "incomplete": 0,
                          "total": requests}, totals
        done = b["requests"]["successful"]
        assert [r["output_tokens"] for r in done] == [out_tokens] * requests
        assert all(r["prompt_tokens"] > 0 for r in done)
    api.leak_check()


@pytest.mark.skipif(not INFERENCE_PERF.exists(), reason="no .venv-perf: inference-perf needs "
                    "Python >= 3.12, and `make perf-venv` found none")
def test_inference_perf_sweep(api, tiny_model_dir, tmp_path) -> None:
    stages = [(2, 2), (4, 2)]  # (requests per second, seconds)
    config = {"server": {"type": "vllm", "base_url": api.url},
              "tokenizer": {"pretrained_model_name_or_path": str(tiny_model_dir)},
              "load": {"type": "constant",
                       "stages": [{"rate": r, "duration": d} for r, d in stages]},
              "storage": {"local_storage": {"path": str(tmp_path / "report")}}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own Python
    run = subprocess.run([str(INFERENCE_PERF), "--config_file", str(tmp_path / "config.yaml")],
                         cwd=tmp_path, env={**env, **OFFLINE}, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = tmp_path / "report"
    for i, (rate, secs) in enumerate(stages):
        stage = json.loads((report / f"stage_{i}_lifecycle_metrics.json").read_text())
        assert stage["successes"]["count"] == rate * secs, stage["successes"]
        assert stage["failures"]["count"] == 0, stage["failures"]
    done = json.loads((report / "summary_lifecycle_metrics.json").read_text())["successes"]
    sent = sum(r * d for r, d in stages)
    out = done["output_tokens"]  # the server's usage; its mock prompts ask for 30
    assert done["count"] == sent and out["total"] == 30 * sent and out["min"] == 30
    assert done["token_count_mismatches"] == 0
    assert json.loads((report / "validation.json").read_text())["global"]["errors"] == []
    api.leak_check()
