"""OpenAI's echo with logprobs and vLLM's prompt_logprobs on /v1/completions, through
the official client against real workers: a short prompt prefilled by the decode
worker, a long one by the prefill worker (its logprobs cross the P/D link, TCP); both
equal one in-process whole-prompt forward's log_softmax (fp32) on the same tiny model."""
from __future__ import annotations

import uuid

import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

SHORT = "hi"  # 2 tokens: the decode worker prefills it (threshold 4)
LONG = "the quick brown fox jumps over the lazy dog"  # through the prefill worker


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax [T, V] of a whole-prompt forward, in-process, as the workers run it."""
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                           num_kv_blocks=256, max_model_len=1024))

    def run(ids: list[int]) -> torch.Tensor:
        table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
        try:
            return torch.log_softmax(eng.runner.prompt_logits(ids, table).float(), dim=1)
        finally:
            eng.kv.pool.free(table)
    return run


def _salt() -> dict:
    """A cache salt of its own: a long prompt then always goes through the prefill worker."""
    return {"cache_salt": uuid.uuid4().hex, "return_token_ids": True}


def _check_echo(choice, prompt: str, reference, tiny_tok, top: int) -> list[int]:
    ids = list(choice.prompt_token_ids)
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp.tokens[:len(ids)] == [tiny_tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4, p
        assert len(lp.top_logprobs[p]) == top
        best = ref[p - 1].topk(top)
        assert sorted(lp.top_logprobs[p].values(), reverse=True) == pytest.approx(
            best.values.tolist(), abs=1e-4)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    return ids


def test_official_client_echo_two_prompts_max_tokens_0(api, reference, tiny_tok) -> None:
    """lm-evaluation-harness's loglikelihood call: each choice is its prompt, scored; the
    short one on the decode worker alone, the long one through the prefill worker."""
    paths = {p: api.requests_total(path=p) for p in ("local_prefill", "disaggregated")}
    r = api.client.completions.create(model="", prompt=[SHORT, LONG], echo=True, logprobs=2,
                                      max_tokens=0, extra_body=_salt())
    assert [c.index for c in r.choices] == [0, 1]
    for c, prompt in zip(r.choices, [SHORT, LONG]):
        assert c.text == prompt and c.finish_reason == "length"
        ids = _check_echo(c, prompt, reference, tiny_tok, 2)
        assert len(c.logprobs.tokens) == len(ids) and list(c.token_ids) == []
    assert r.usage.completion_tokens == 0
    assert all(api.requests_total(path=p) == n + 1 for p, n in paths.items())


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_echo_then_generated_tokens_and_a_prefix_hit(api, reference, tiny_tok, prompt) -> None:
    """The prompt's tokens lead, then the generated ones; a second run whose prompt
    blocks are cached on the workers returns the same logprobs."""
    salt = _salt()
    kw = dict(model="", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0,
              extra_body={**salt, "ignore_eos": True})
    plain = api.client.completions.create(model="", prompt=prompt, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    r = api.client.completions.create(**kw)
    c = r.choices[0]
    ids = _check_echo(c, prompt, reference, tiny_tok, 1)
    assert c.text == prompt + plain.choices[0].text
    assert len(c.logprobs.tokens) == len(ids) + 3
    assert all(x is not None for x in c.logprobs.token_logprobs[len(ids):])
    again = api.client.completions.create(**kw).choices[0]
    assert again.logprobs.token_logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:],
                                                              abs=1e-4)


def test_echo_streamed_is_the_same_text(api) -> None:
    kw = dict(model="", prompt=LONG, echo=True, max_tokens=3, temperature=0,
              extra_body={"ignore_eos": True})
    full = api.client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in api.client.completions.create(**kw, stream=True)
             if c.choices]
    assert "".join(parts) == full and full.startswith(LONG)


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_vllm_prompt_logprobs(api, reference, prompt) -> None:
    r = api.client.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={**_salt(), "prompt_logprobs": 2})
    c = r.choices[0]
    ids = list(c.prompt_token_ids)
    got = c.model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        entry = got[p]
        assert abs(entry[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
        best = ref[p - 1].topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]


def test_echo_with_a_prompt_over_the_context_window_names_it(api) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model="", prompt="x" * 1100, echo=True, logprobs=1,
                                      max_tokens=0)
    assert e.value.body["param"] == "prompt", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model="", prompt="x", max_tokens=1,
                                      extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs", e.value.body
