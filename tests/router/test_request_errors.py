"""A request that fails on its decode worker (the engine's step raised for its batch; a
grammar that allows no token) ends that request only, and its caller hears what failed:
the decode stream's last chunk carries finish_reason "error" and the error's text, and
the router answers an OpenAI error object with that text (HTTP 500, or an error event in
a stream that has sent tokens) instead of finish_reason "error" and no word of why. The worker serves on and
holds nothing. A real decode worker in-process behind the router's app."""
from __future__ import annotations

import asyncio
import json

from engine.model_runner import ModelRunner
from proto import decode_pb2
from tests.router.test_field_errors import router_client
from tests.services.conftest import leak_check, sampling, services

PROMPT = [(i * 7) % 300 + 3 for i in range(20)]


def test_a_failed_request_says_why_over_grpc_and_http(tiny_model_dir, monkeypatch) -> None:
    failing = {"on": True, "spare": 0}  # spare: steps that run before the failure
    execute = ModelRunner.execute

    def flaky(self, *a, **k):
        if failing["on"] and failing["spare"] == 0:
            raise RuntimeError("injected forward failure")
        failing["spare"] -= 1
        return execute(self, *a, **k)
    monkeypatch.setattr(ModelRunner, "execute", flaky)

    async def body():
        async with services(tiny_model_dir) as (_, d, _, dstub):
            chunks = [c async for c in dstub.Generate(decode_pb2.GenerateRequest(
                request_id="g", prompt_token_ids=PROMPT, sampling=sampling(4)))]
            async with router_client(tiny_model_dir, d) as c:
                plain = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                early = await c.post("/v1/completions", json={  # before any token
                    "prompt": PROMPT, "max_tokens": 4, "stream": True})
                failing["spare"] = 2  # the prompt and one decode step, then the failure
                streamed = await c.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "stream": True, "logprobs": 1})
                failing["on"] = False
                after = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            await leak_check(d)
            return chunks, plain, early, streamed, after

    chunks, plain, early, streamed, after = asyncio.run(asyncio.wait_for(body(), 120))
    assert chunks[-1].finished and chunks[-1].finish_reason == "error"
    assert "injected forward failure" in chunks[-1].error
    assert plain.status_code == 500, plain.text
    err = plain.json()["error"]
    assert err["type"] == "server_error" and "injected forward failure" in err["message"], err
    assert early.status_code == 500 and "injected forward failure" in early.text
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["choices"][0]["logprobs"]["tokens"], events  # tokens came first
    assert "injected forward failure" in events[-1]["error"]["message"], events
    assert not any(ch.get("finish_reason") == "error"
                   for e in events for ch in e.get("choices", []))
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
