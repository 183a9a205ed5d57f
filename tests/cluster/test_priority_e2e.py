"""Issue 5 over HTTP: a decode worker whose pool holds 4 requests, 12 requests of
mixed priority at once through the router; all complete with the unconstrained
outputs, /metrics shows the preemptions, and both workers end empty."""
from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
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


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_twelve_mixed_priority_requests_over_http(tiny_model_dir, mode) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64,
                                 num_kv_blocks=256))
    want = []
    for b in _requests():
        sp = SamplingParams(max_tokens=OUT, ignore_eos=True, temperature=b["temperature"],
                            seed=b.get("seed"))
        want.append(eng.tokenizer.decode(eng.generate([b["prompt"]], sp)[0].token_ids))
    args = ["--dtype", "float32", "--max-model-len", "64", "--kv-blocks", "16",
            "--preemption-mode", mode, "--swap-space", "0.01" if mode == "swap" else "0"]
    # Prompts prefill on the decode worker itself (-1), so all 12 reach its scheduler at
    # once whatever the machine's load; through a prefill worker they may trickle in and
    # never fill the pool (the disaggregated path is checked for exact tokens elsewhere).
    with cluster(tiny_model_dir, "tcp", worker_args=args,
                 router_args=["--local-prefill-threshold", "none"]) as c:
        def send(body):
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        # Sent least important first: those are in flight when the rest arrive, so the
        # router admits the rest at once (the worker preempts to make room). Sent in any
        # order, the router's admission may rightly hold back less important ones while
        # the pool is full, and then nothing needs preempting.
        reqs = _requests()
        order = sorted(range(len(reqs)), key=lambda i: -reqs[i]["priority"])
        with cf.ThreadPoolExecutor(12) as pool:
            texts = dict(zip(order, pool.map(send, [reqs[i] for i in order])))
        got = [texts[i] for i in range(len(reqs))]
        assert got == want
        m = c.metrics(c.decode[0])
        n = sum(float(v) for v in re.findall(
            rf'tandem:num_preemptions_total\{{[^}}]*mode="{mode}"[^}}]*\}} (\S+)', m))
        assert n > 0, "expected preemptions in a 4-request pool"
        c.leak_check()

