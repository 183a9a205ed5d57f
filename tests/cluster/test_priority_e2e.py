"""Issue 5 over HTTP: a decode worker with one seat, a long request of the least
importance and then 12 requests of mixed priority through the router; all complete
with the unconstrained outputs, /metrics shows the preemptions, and both workers end
empty."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams
from tests.cluster.launch import cluster

PROMPT_LEN, OUT = 20, 40


def _requests():
    out = []
    for i in range(12):
        prompt = [(i * 13 + j * 7) % 300 + 3 for j in range(PROMPT_LEN)]
        body = {"prompt": prompt, "max_tokens": OUT, "ignore_eos": True,
                "temperature": 0.9 if i % 2 else 0.0, "priority": i % 3}
        if i % 2:
            body["seed"] = 100 + i
        out.append(body)
    return out


LONG = {"prompt": [(j * 11) % 300 + 3 for j in range(PROMPT_LEN)], "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0.0, "priority": 3, "stream": True}
"""The least important request, long (1,500 steps: over a second on the tiny model,
where each of the twelve takes some 25 ms), so it is surely running when they arrive."""


def _stream_text(url: str, body: dict, started: threading.Event) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    return "".join(parts)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_twelve_mixed_priority_requests_over_http(tiny_model_dir, mode) -> None:
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                           max_model_len=1536, num_kv_blocks=256))
    want = []
    for b in _requests() + [LONG]:
        sp = SamplingParams(max_tokens=b["max_tokens"], ignore_eos=True,
                            temperature=b["temperature"], seed=b.get("seed"))
        want.append(eng.tokenizer.decode(eng.generate([b["prompt"]], sp)[0].token_ids))
    # One seat: each arrival more important than the request in it preempts that one
    # (a step's work, not a race between HTTP requests: the twelve finish in some 25 ms
    # each on the tiny model, faster than they trickle in, so a pool of seats or blocks
    # they had to share was full only when they happened to overlap; CI saw 0
    # preemptions that way more than once).
    args = ["--dtype", "float32", "--max-model-len", "1536", "--kv-blocks", "128",
            "--max-num-seqs", "1", "--preemption-mode", mode,
            "--swap-space", "0.01" if mode == "swap" else "0"]
    # Prompts prefill on the decode worker itself (--local-prefill-threshold none), so they
    # reach its scheduler as they arrive, not when a prefill worker is done with them
    # (the disaggregated path is checked for exact tokens elsewhere).
    with cluster(tiny_model_dir, "tcp", worker_args=args,
                 router_args=["--local-prefill-threshold", "none"]) as c:
        def send(body):
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        # The long, least important request streams first; the twelve go once its first
        # token came back, so it is running when they arrive, and the router admits them
        # past it (a less important request is in flight).
        started = threading.Event()
        with cf.ThreadPoolExecutor(13) as pool:
            long_text = pool.submit(_stream_text, c.url, LONG, started)
            assert started.wait(120), "the long request never started"
            texts = list(pool.map(send, _requests()))
            got = texts + [long_text.result()]
        assert got == want
        m = c.metrics(c.decode[0])
        n = sum(float(v) for v in re.findall(
            rf'tandem:num_preemptions_total\{{[^}}]*mode="{mode}"[^}}]*\}} (\S+)', m))
        assert n > 0, "expected preemptions: 13 requests for one seat"
        c.leak_check()
