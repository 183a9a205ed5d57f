"""Batches of prompts on /v1/completions (strings, token ids, lists of either): one
response with a choice per prompt, indexed as OpenAI numbers them, streamed or not,
each choice what that prompt alone gives; a prompt's error is a 400 naming
prompt[i]; a client that goes away mid-batch has every sub-request aborted on every
worker, and nothing is left held."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

PROMPTS = ["hi", "the quick brown fox jumps over", "one more, longer than four"]
IDS = [[70, 71], [70, 71, 72, 73, 74, 75, 76]]


def _one(api, prompt, **kw) -> openai.types.Completion:
    return api.client.completions.create(model="", prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, **kw})


def test_a_choice_per_prompt_each_as_alone(api, tiny_tok) -> None:
    alone = [_one(api, p) for p in PROMPTS]
    batch = _one(api, PROMPTS, return_token_ids=True)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert [c.prompt_token_ids for c in batch.choices][0] == tiny_tok.encode("hi")
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18
    one = _one(api, [PROMPTS[1]])  # a list of one prompt: one choice
    assert [c.text for c in one.choices] == [alone[1].choices[0].text]
    ids = _one(api, IDS, return_token_ids=True)  # token-id prompts, alone and batched
    assert [c.text for c in ids.choices] == [_one(api, p).choices[0].text for p in IDS]
    assert [c.prompt_token_ids for c in ids.choices] == IDS


def test_streamed_batch_interleaves_choices_by_index(api) -> None:
    batch = _one(api, PROMPTS, logprobs=1)
    chunks = list(api.client.completions.create(
        model="", prompt=PROMPTS, max_tokens=6, temperature=0, stream=True, logprobs=1,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, reasons = ["", "", ""], [[], [], []]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index].append(c.finish_reason)
    assert texts == [c.text for c in batch.choices]
    assert reasons == [["length"]] * 3
    assert chunks[-1].usage.completion_tokens == batch.usage.completion_tokens == 18


@pytest.mark.parametrize("prompt,param", [
    ([[5, 6], [1, 999999]], "prompt[1]"), ([[5, 6], []], "prompt[1]"),
    (["x" * 5000, "ok"], "prompt[0]"), ([], "prompt"), (["a"] * 257, "prompt"),
    (["a", [5]], "prompt"),
])
def test_a_prompts_error_names_it(api, prompt, param) -> None:
    r = httpx.post(api.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param.startswith("prompt["):
        assert r.json()["error"]["message"].startswith(param)


LONG_BATCH = {"prompt": ["a b c", "the slow brown dog sleeps", "x y z w"], "max_tokens": 900,
              "ignore_eos": True, "temperature": 0}


def test_a_client_gone_mid_stream_aborts_every_prompt(api) -> None:
    before = api.requests_total(finish_reason="abort")
    with httpx.stream("POST", api.url + "/v1/completions", timeout=60,
                      json={**LONG_BATCH, "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    api.leak_check()
    assert api.load(api.decode[0]).num_running == 0
    assert api.requests_total(finish_reason="abort") == before + 3


def test_a_client_gone_before_the_response_aborts_every_prompt(api) -> None:
    """Not streamed: the client closes its socket while the three sub-requests run."""
    before = api.requests_total(finish_reason="abort")
    u = urlparse(api.url)
    body = json.dumps(LONG_BATCH).encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(600):  # until all three run on the decode worker (bounded)
            if api.load(api.decode[0]).num_running == 3:
                break
            time.sleep(0.05)
        assert api.load(api.decode[0]).num_running == 3
    api.leak_check()
    assert api.requests_total(finish_reason="abort") == before + 3
