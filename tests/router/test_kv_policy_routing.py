"""A request's ``kv_policy`` through the router's HTTP API to real in-process prefill and
decode workers (tests/services/test_kv_policy_handoff.py runs the handoff itself): it
goes to both halves, so the disaggregated completion equals the decode worker's
colocated tokens; a malformed policy is a 400 naming kv_policy at the router, and one a
worker refuses (a budget past its context window) is a 400 naming kv_policy too. A
bounded request's length is checked against --max-stream-len, as its workers check it:
one past the context window goes through, one past the stream length is a 400 naming
the field, at the router; truncate_prompt_tokens=-1 keeps what the stream length holds."""
from __future__ import annotations

import asyncio

import httpx

from auth.grpc_auth import channel as auth_channel
from core.tokenizer import Tokenizer
from proto import decode_pb2_grpc, prefill_pb2_grpc
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from router.flow import RequestFlow
from router.metrics import RouterMetrics
from router.state import RouterState
from router.workers import Worker
from tests.router.test_flow import FakePool
from tests.services.conftest import leak_check, services
from tests.services.test_kv_policy_handoff import (MAX_TOKENS, PROMPTS, SERVER, _generate,
                                                   sharp_model)  # noqa: F401 - a fixture

STREAMING = "streaming:sinks=4,window=44"
STREAM_LEN = 160
WORKERS = {**SERVER, "max_stream_len": STREAM_LEN}  # a context window of 128


def _app(model_dir, workers: list[Worker]):
    cfg = RouterConfig(model=str(model_dir), decode=("127.0.0.1:1",), local_prefill_threshold=0,
                       max_model_len=SERVER["max_model_len"], max_stream_len=STREAM_LEN)
    app = create_app(cfg)
    tok = Tokenizer.load(model_dir)
    pool = FakePool(workers)
    app.state.router = RouterState(cfg, "tiny", tok, pool, RequestFlow(cfg, tok, pool),
                                   RouterMetrics(), Admission(8, 8))
    return app


def test_kv_policy_goes_to_both_halves_and_bad_ones_are_400s(sharp_model) -> None:  # noqa: F811
    prompt = PROMPTS["mid-block"]
    long = [(i * 37) % 300 + 3 for i in range(130)]  # past the context window

    async def post(c, policy: str, ids: list[int] = prompt, n: int = MAX_TOKENS,
                   **extra) -> httpx.Response:
        return await c.post("/v1/completions", json={
            "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_policy": policy, **extra})

    async def body():
        async with services(sharp_model, prefill_engine=WORKERS,
                            decode_engine=WORKERS) as (p, d, _, ds):
            colocated, _ = await _generate(ds, "colocated", prompt, STREAMING)
            pch = auth_channel(f"127.0.0.1:{p.port}", p.secret)
            dch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
            workers = [Worker(f"127.0.0.1:{p.port}", "prefill", pch,
                              prefill_pb2_grpc.PrefillStub(pch), healthy=True),
                       Worker(f"127.0.0.1:{d.port}", "decode", dch,
                              decode_pb2_grpc.DecodeStub(dch), healthy=True)]
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(
                        app=_app(sharp_model, workers)), base_url="http://router") as c:
                    replies = [await post(c, policy) for policy in (
                        STREAMING, "streaming:sinks=4", "streaming:sinks=4,window=200")]
                    replies += [await post(c, STREAMING, long, 20),  # 150 tokens
                                await post(c, STREAMING, prompt, STREAM_LEN - 69),
                                await post(c, STREAMING, long * 2, 1),
                                await post(c, "full", prompt, 59),
                                await post(c, STREAMING, long * 2, 20, truncate_prompt_tokens=-1)]
            finally:
                await pch.close()
                await dch.close()
            pulled = sum(s.value for m in d.metrics.registry.collect() for s in m.samples
                         if s.name == "tandem:kv_transfer_blocks_total")
            await leak_check(p, d)
            return colocated, replies, pulled

    colocated, replies, pulled = asyncio.run(body())
    ok, malformed, too_big, past_window, past_stream, long_prompt, full, cut = replies
    # -1 keeps what the request's own limit holds: the stream length, past the window
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == STREAM_LEN - 20
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["token_ids"] == colocated
    assert past_window.status_code == 200, past_window.text
    assert len(past_window.json()["choices"][0]["token_ids"]) == 20
    assert pulled == 3 + 3 + 3  # the kept blocks of the 70-, 130- and 140-token prompts
    for r, param, words in ((malformed, "kv_policy", "needs sinks and window"),
                            (too_big, "kv_policy", "exceeds the context window"),
                            (past_stream, "max_tokens", "exceed a bounded kv_policy's length "
                                                        "(max_stream_len), 160"),
                            (long_prompt, "prompt", "prompt has 260 tokens; a bounded"),
                            (full, "max_tokens", "exceed the context window (max_model_len), "
                                                 "128")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
