"""n > 1 and best_of through the router and real workers (a cluster as `api`, on the
tiny model with nearly flat logits so that seeded choices part: prefill and decode
workers over TCP; prompts of more than 4 tokens are prefilled on the prefill
worker and the decode worker forks the choices after its one pull, shorter ones are
prefilled on the decode worker itself): the official client's chat n=3, streamed with
each choice's index; P/D equals the colocated engine; a batch of prompts x n numbered
i*n + j; best_of keeps the best; bad input names its field; a client gone mid-stream
leaves nothing held."""
from __future__ import annotations

import httpx
import pytest

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

from tests.router.conftest import api_cluster

LONG = [5 + (7 * i) % 200 for i in range(23)]  # through the prefill worker
SHORT = [70, 71, 72]  # prefilled on the decode worker


@pytest.fixture(scope="module")
def api(flat_model_dir):
    with api_cluster(flat_model_dir) as c:
        yield c


def _chat(api, **kw):
    return api.client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "tell me something"}], max_tokens=6,
        temperature=1.0, seed=5, extra_body={"ignore_eos": True}, **kw)


def test_openai_chat_n3_streamed_with_indices(api) -> None:
    full = _chat(api, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) == 3 and full.usage.completion_tokens == 18
    assert _chat(api, n=3).choices[1].message.content == texts[1]  # seeded: reproducible
    assert _chat(api).choices[0].message.content == texts[0]  # choice 0 is n = 1's
    streamed, reasons, roles = [""] * 3, [[] for _ in range(3)], [0] * 3
    for chunk in _chat(api, n=3, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            if c.finish_reason:
                reasons[c.index].append(c.finish_reason)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 18
    assert streamed == texts and reasons == [["length"]] * 3 and roles == [1, 1, 1]


@pytest.fixture(scope="module")
def colocated(flat_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(flat_model_dir), dtype="float32",
                                            max_model_len=1024, num_kv_blocks=256))


def _engine_choices(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    eng.add_request(prompt, params, request_id="ref")
    out: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
    eng.leak_check()
    return [out[j] for j in sorted(out)]


@pytest.mark.parametrize("prompt,path", [(LONG, "disaggregated"), (SHORT, "local_prefill")])
def test_n2_equals_the_colocated_engine(api, colocated, prompt, path) -> None:
    before = api.requests_total(path=path)
    r = api.client.completions.create(model="", prompt=prompt, n=2, max_tokens=8,
                                      temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert api.requests_total(path=path) == before + 1
    want = _engine_choices(colocated, prompt, SamplingParams(
        max_tokens=8, temperature=1.0, seed=11, n=2, ignore_eos=True))
    assert [c.token_ids for c in r.choices] == want and want[0] != want[1]
    api.leak_check()


def test_batch_of_prompts_times_n_is_numbered_i_n_plus_j(api) -> None:
    kw = dict(model="", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [api.client.completions.create(prompt=p, **kw).choices[0].text
             for p in (SHORT, LONG)]
    r = api.client.completions.create(prompt=[SHORT, LONG], n=2, **kw)
    assert [(c.index, c.text) for c in r.choices] == [
        (0, alone[0]), (1, alone[0]), (2, alone[1]), (3, alone[1])]
    assert r.usage.completion_tokens == 20


def test_best_of_returns_the_n_most_likely(api) -> None:
    kw = dict(model="", prompt=LONG, max_tokens=6, temperature=1.0, seed=3, logprobs=0,
              extra_body={"ignore_eos": True})
    three = api.client.completions.create(n=3, **kw).choices
    best = api.client.completions.create(n=2, best_of=3, **kw)
    ranked = sorted(three, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 18  # every sequence generated counts
    plain = api.client.completions.create(n=1, best_of=2, model="", prompt=LONG, max_tokens=6,
                                          temperature=1.0, seed=3,
                                          extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None  # ranked by logprobs, not asked for


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 17, "n": 1}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
])
def test_bad_choices_name_their_field(api, body, param) -> None:
    r = httpx.post(api.url + "/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_with_streamed_tool_calls_is_refused(api) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(api.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True,
        "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_client_gone_mid_stream_frees_every_fork(api) -> None:
    before = api.requests_total(finish_reason="abort")
    with httpx.stream("POST", api.url + "/v1/completions", timeout=60, json={
            "prompt": LONG, "n": 4, "max_tokens": 900, "ignore_eos": True, "seed": 1,
            "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:  # every choice has started
                break
    api.leak_check()
    assert api.load(api.decode[0]).num_running == 0
    assert api.requests_total(finish_reason="abort") == before + 1
