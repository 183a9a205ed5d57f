"""OpenAI's and vLLM's request fields through the official client (vLLM's in
extra_body) against real workers: each implemented sampling field changes the tokens
exactly as its definition says, on both paths (a short prompt prefilled by the decode
worker, a long one through the prefill worker, whose first token it samples); fields
accepted with no effect change nothing; refused and unknown fields are 400s naming
them."""
from __future__ import annotations

import uuid

import openai
import pytest


SHORT = "hi"  # 2 tokens: prefilled by the decode worker (threshold 4)
LONG = "the quick brown fox jumps over"  # through the prefill worker
EOS = 0


def _run(api, prompt: str, max_tokens: int = 8, **extra) -> openai.types.Completion:
    """A greedy completion whose prompt is never cached (its own cache salt), so a long
    prompt always goes through the prefill worker."""
    body = {"ignore_eos": True, "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
            **extra}
    return api.client.completions.create(model="", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, extra_body=body)


def _ids(r) -> list[int]:
    return list(r.choices[0].token_ids)


@pytest.fixture(params=["local_prefill", "disaggregated"])
def prompt(request, api):
    """Each test runs on both paths; the router's metrics show it took the one named."""
    before = api.requests_total(path=request.param)
    yield SHORT if request.param == "local_prefill" else LONG
    assert api.requests_total(path=request.param) > before


def test_logit_bias_bans_the_greedy_choice_and_forces_another(api, prompt) -> None:
    base = _ids(_run(api, prompt))
    banned = _ids(_run(api, prompt, logit_bias={str(base[0]): -100}))
    assert banned[0] != base[0] and base[0] not in banned
    forced = _ids(_run(api, prompt, max_tokens=4, logit_bias={"65": 100}))
    assert forced == [65] * 4


def test_allowed_token_ids_restrict_every_token(api, prompt, tiny_tok) -> None:
    allowed = [tiny_tok.encode(ch, add_special_tokens=False)[0] for ch in "xyz"]
    r = _run(api, prompt, max_tokens=12, allowed_token_ids=allowed)
    assert len(_ids(r)) == 12 and set(_ids(r)) <= set(allowed)
    assert set(r.choices[0].text) <= set("xyz")


def test_bad_words_never_appear(api, prompt, tiny_tok) -> None:
    letters = [tiny_tok.encode(ch, add_special_tokens=False)[0] for ch in "abc"]
    base = _run(api, prompt, max_tokens=12, allowed_token_ids=letters)
    word = base.choices[0].text[:2]  # a two-token word the greedy run wrote
    r = _run(api, prompt, max_tokens=12, allowed_token_ids=letters, bad_words=[word, "c"])
    assert word not in r.choices[0].text and "c" not in r.choices[0].text
    assert len(_ids(r)) == 12


def test_min_tokens_holds_eos_and_stop_ids_back(api, prompt) -> None:
    eos_first = _run(api, prompt, ignore_eos=False, logit_bias={str(EOS): 100})
    assert _ids(eos_first) == [EOS] and eos_first.choices[0].finish_reason == "stop"
    r = _run(api, prompt, ignore_eos=False, logit_bias={str(EOS): 100}, min_tokens=5)
    ids = _ids(r)
    assert len(ids) == 6 and EOS not in ids[:5] and ids[5] == EOS
    assert r.choices[0].finish_reason == "stop"
    stop_id = _run(api, prompt, logit_bias={"70": 100}, stop_token_ids=[70], min_tokens=3)
    assert _ids(stop_id)[-1] == 70 and len(_ids(stop_id)) == 4


def test_stop_token_ids_end_the_output(api, prompt) -> None:
    base = _ids(_run(api, prompt))
    r = _run(api, prompt, stop_token_ids=[base[2]])
    assert _ids(r) == base[:base.index(base[2]) + 1]
    assert r.choices[0].finish_reason == "stop"


def test_stop_string_kept_or_cut_and_min_tokens_delays_it(api, prompt, tiny_tok) -> None:
    x = tiny_tok.encode("x", add_special_tokens=False)[0]
    only_x = dict(allowed_token_ids=[x], max_tokens=6)
    assert _run(api, prompt, stop=["xx"], **only_x).choices[0].text == ""
    assert _run(api, prompt, stop=["xx"], include_stop_str_in_output=True,
                **only_x).choices[0].text == "xx"
    late = _run(api, prompt, stop=["xx"], min_tokens=3, include_stop_str_in_output=True, **only_x)
    assert late.choices[0].text == "xxxxx"  # searched only after the first three tokens


def test_skip_special_tokens(api, prompt) -> None:
    special = dict(allowed_token_ids=[2], max_tokens=3)  # <|im_end|>
    assert _run(api, prompt, **special).choices[0].text == ""
    assert _run(api, prompt, skip_special_tokens=False,
                **special).choices[0].text == "<|im_end|>" * 3


def test_truncate_prompt_tokens_and_return_token_ids(api, tiny_tok) -> None:
    ids = tiny_tok.encode(LONG, add_special_tokens=False)
    r = _run(api, LONG, truncate_prompt_tokens=3)
    assert r.usage.prompt_tokens == 3 and r.choices[0].prompt_token_ids == ids[-3:]
    assert _ids(r) == _ids(_run(api, tiny_tok.decode(ids[-3:])))
    full = _run(api, LONG)
    assert full.choices[0].prompt_token_ids == ids and len(_ids(full)) == 8


def test_streamed_token_ids_and_ids_as_logprob_tokens(api, tiny_tok) -> None:
    base = _run(api, LONG)
    chunks = list(api.client.completions.create(
        model="", prompt=LONG, max_tokens=8, temperature=0, stream=True, logprobs=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == tiny_tok.encode(LONG, add_special_tokens=False)
    streamed = [t for ch in chunks for t in (ch.choices[0].token_ids or [])]
    assert streamed == _ids(base)
    names = [t for ch in chunks if ch.choices[0].logprobs
             for t in ch.choices[0].logprobs.tokens]
    assert names == [f"token_id:{t}" for t in streamed]


NO_EFFECT = dict(metadata={"k": "v"}, store=False, service_tier="auto", user="u",
                 safety_identifier="s", prompt_cache_key="p", reasoning_effort="low",
                 verbosity="low", modalities=["text"], prediction={"type": "content",
                                                                   "content": "x"},
                 parallel_tool_calls=True, prompt_cache_retention="24h",
                 stream_options=None, temperature=None, top_p=None, n=None)


def test_fields_without_effect_change_nothing(api) -> None:
    msgs = [{"role": "user", "content": "say"}]
    kw = dict(model="", messages=msgs, max_tokens=6, seed=3,
              extra_body={"ignore_eos": True, "spaces_between_special_tokens": True,
                          "request_id": "r1", "include_reasoning": False,
                          "guided_decoding_backend": "auto", "length_penalty": 1.0})
    plain = api.client.chat.completions.create(**kw)
    busy = api.client.chat.completions.create(**kw, **NO_EFFECT)
    assert busy.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("field,value", [
    ("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("logit_bias", {"999999": 1}), ("logit_bias", {"5": 101}), ("allowed_token_ids", [10**6]),
    ("min_tokens", 100), ("prompt_logprobs", 21), ("echo", True), ("chat_template", "x"),
    ("truncate_prompt_tokens", 10**6), ("no_such_field", 1),
])
def test_refused_and_unknown_fields_are_400s_naming_them(api, field, value) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        api.client.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=4, extra_body={field: value})
    assert e.value.body["param"] == field, e.value.body
