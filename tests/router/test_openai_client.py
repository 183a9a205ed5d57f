"""The official openai Python client against `tandem up` (a real subprocess):
chat and completions, streaming and not, stop strings, max_tokens, seed,
logprobs; errors raise the client's typed exceptions."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.launch import tandem_up

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with tandem_up(tiny_model_dir, ["--kv-transfer", "tcp", "--dtype", "float32", "--kv-blocks",
                                    "128", "--max-model-len", "256",
                                    "--local-prefill-threshold", "4"]) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        c.server_url = url
        yield c


def _model(client) -> str:
    return client.models.list().data[0].id


def test_completions_plain_and_streamed_agree(client) -> None:
    m = _model(client)
    full = client.completions.create(model=m, prompt="hello there, friend", max_tokens=7,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 7
    parts = [c.choices[0].text for c in client.completions.create(
        model=m, prompt="hello there, friend", max_tokens=7, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(parts) == full.choices[0].text


def test_chat_streaming_usage_seed_and_logprobs(client) -> None:
    m = _model(client)
    msgs = [{"role": "user", "content": "tell me something"}]
    a = client.chat.completions.create(model=m, messages=msgs, max_tokens=6, temperature=0.9,
                                       seed=7, logprobs=True, extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model=m, messages=msgs, max_tokens=6, temperature=0.9,
                                       seed=7, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded
    lps = a.choices[0].logprobs.content
    assert len(lps) == 6 and all(x.logprob <= 0 for x in lps)
    stream = client.chat.completions.create(model=m, messages=msgs, max_tokens=6,
                                            temperature=0.9, seed=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_top_logprobs_chat_and_completions(client) -> None:
    """Greedy: the chosen token is the most likely one, so it heads its top list with
    the same logprob; the lists have the requested length, on the first token (from
    the prefill worker) and on the later ones (from the decode worker), streamed too."""
    m = _model(client)
    msgs = [{"role": "user", "content": "name a colour"}]
    r = client.chat.completions.create(model=m, messages=msgs, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for x in content:
        assert len(x.top_logprobs) == 3
        assert x.top_logprobs[0].token == x.token
        assert abs(x.top_logprobs[0].logprob - x.logprob) < 1e-4
        assert x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob >= x.top_logprobs[2].logprob

    c = client.completions.create(model=m, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(d) == 2 for d in lp.top_logprobs)
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert abs(top[tok] - tlp) < 1e-4
    stream = client.completions.create(model=m, prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = [d for ch in stream if ch.choices and ch.choices[0].logprobs
                for d in ch.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs


def test_stop_strings(client) -> None:
    m = _model(client)
    base = client.completions.create(model=m, prompt="abcdefgh", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    cut = client.completions.create(model=m, prompt="abcdefgh", max_tokens=10, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_errors_are_typed(client) -> None:
    m = _model(client)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=m, prompt="x", max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=m, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                       temperature=7)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=m, prompt="y" * 400, max_tokens=2)


def test_schemathesis_finds_no_server_error(client) -> None:
    """A bounded schemathesis run against the served OpenAPI schema: no 5xx, no crash."""
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        pytest.skip("schemathesis is not installed (dev extra)")
    r = subprocess.run([str(st), "run", client.server_url + "/openapi.json", "--checks",
                        "not_a_server_error", "--max-examples", "15", "--seed", "1",
                        "--request-timeout", "30"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert re.search(r"(\d+) generated, \1 passed", r.stdout), r.stdout[-1500:]
    assert httpx.get(client.server_url + "/health").status_code == 200  # still up
