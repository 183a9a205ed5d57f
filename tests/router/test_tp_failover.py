"""Issue 26: a decode group at --tensor-parallel-size 2 loses a rank mid-stream during
20 streams. The group fails as one (its worker process exits), the router resumes each
of its streams on the other decode worker from the tokens already streamed, every
stream ends with the colocated engine's greedy text, and the surviving workers hold no
block, request or lease once idle. Small random Llama (tests/models/families.py), fp32.

The group sums its row-parallel products in another order than one process does, so a
pick whose top-2 logits are within fp32 noise may go either way (one of the first 20
prompts here has a 1e-6 gap at its fifth token). The streams use the first 20
candidate prompts whose whole colocated greedy path keeps every gap above MARGIN, so
equal text is Tandem's behaviour, not the checkpoint's luck.

About 40 s here: four worker processes (prefill, the TP-2 group's two ranks, the other
decode worker) and the router start once; the streams themselves take seconds."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.cluster.launch import cluster, stream_events
from tests.models.conftest import checkpoint  # noqa: F401 - the shared checkpoint fixture
from tests.models.families import greedy_margin

STREAMS = 20
NEW_TOKENS = 120
ENGINE = {"dtype": "float32", "quantization": "none", "block_size": 8, "max_model_len": 256,
          "attention_backend": "sdpa", "compile": False}
FLAGS = ["--dtype", "float32", "--quantization", "none", "--block-size", "8",
         "--max-model-len", "256", "--attention-backend", "sdpa", "--no-compile",
         "--kv-blocks", "256"]
CANDIDATES = [f"stream {i}: the quick brown fox jumps over {i * 7} lazy dogs" for i in range(40)]
MARGIN = 1e-3


def _stream(url: str, prompt: str, events: list[int]) -> tuple[str, str | None]:
    """One streamed greedy completion: its text and last finish reason; counts events."""
    text, reason = [], None
    with httpx.stream("POST", url + "/v1/completions", timeout=180, json={
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for ev in stream_events(r):
            text.append(ev["choices"][0]["text"])
            reason = ev["choices"][0]["finish_reason"] or reason
            events.append(1)
    return "".join(text), reason


def _rank1(group) -> psutil.Process:
    [rank] = [p for p in psutil.Process(group.popen.pid).children(recursive=True)
              if "engine.parallel.follower" in " ".join(p.cmdline())]
    return rank


def test_killing_a_rank_of_a_tp2_decode_group_during_20_streams(checkpoint) -> None:  # noqa: F811
    model = checkpoint("llama")
    ref = LLMEngine(EngineConfig.from_flat(model=str(model), num_kv_blocks=256, **ENGINE))
    done = ref.generate(CANDIDATES, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    decisive = [(p, o.text) for p, o in zip(CANDIDATES, done)
                if greedy_margin(ref, o.prompt_token_ids, o.token_ids) > MARGIN][:STREAMS]
    assert len(decisive) == STREAMS, f"only {len(decisive)} decisive prompts"
    prompts, want = [p for p, _ in decisive], [t for _, t in decisive]
    with cluster(model, "tcp", n_prefill=1, n_decode=2, worker_args=FLAGS,
                 decode_args=[["--tensor-parallel-size", "2"]],
                 router_args=["--local-prefill-threshold", "0"]) as c:
        group, rank1 = c.decode[0], _rank1(c.decode[0])
        events: list[int] = []
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(_stream, c.url, p, events) for p in prompts]
            deadline = time.monotonic() + 120
            while not (len(events) >= STREAMS and c.load(group).num_running):
                assert time.monotonic() < deadline, "the TP-2 group never ran a stream"
                assert not all(f.done() for f in futures), "every stream ended before the kill"
                time.sleep(0.05)
            rank1.kill()
            got = [f.result() for f in futures]
        assert group.popen.wait(timeout=60) != 0  # the group failed as one: its worker left
        assert [t for t, _ in got] == want
        assert all(r == "length" for _, r in got)
        c.leak_check()  # the surviving workers hold nothing
