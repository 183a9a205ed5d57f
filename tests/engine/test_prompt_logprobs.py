"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs) computed
during prefill: across chunks, with a prefix hit on the prompt, with max_tokens 0 (the
prompt is all the request runs); the reference is one whole-prompt forward's
log_softmax in fp32. Tiny random Llama, chunks of 16 tokens."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import FinishReason

CHUNK = 16
PROMPT = [3 + (i * 7) % 90 for i in range(50)]  # 50 tokens: four chunks


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32",
                                           num_kv_blocks=64, max_model_len=256,
                                           max_num_batched_tokens=CHUNK))
    yield eng
    eng.leak_check()


def _reference(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over ids: [T, V] fp32."""
    table = eng.kv.pool.allocate(eng.kv.blocks_needed(len(ids)))
    try:
        return torch.log_softmax(eng.runner.prompt_logits(ids, table).float(), dim=1)
    finally:
        eng.kv.pool.free(table)


def _run(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    rid = eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def _check(eng: LLMEngine, prompt: list[int], got, top: int) -> None:
    ref = _reference(eng, prompt)
    assert len(got) == len(prompt) - 1  # every token but the first
    for p, lp in enumerate(got):
        assert lp.token_id == prompt[p + 1]
        assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < 1e-4, p
        vals, ids = ref[p].topk(top)
        assert [t for t, _ in lp.top] == ids.tolist(), p
        assert max((abs(v - w) for (_, v), w in zip(lp.top, vals.tolist())), default=0) < 1e-4


def test_max_tokens_0_runs_the_prompt_in_chunks_and_returns_its_logprobs(engine) -> None:
    before = engine.num_computed_tokens_total
    outs = _run(engine, PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].new_token_ids == [] and outs[0].num_output_tokens == 0
    assert engine.num_computed_tokens_total - before == len(PROMPT)  # the prompt, nothing more
    _check(engine, PROMPT, outs[0].prompt_logprobs, 3)
    engine.leak_check()


def test_a_prefix_hit_does_not_lose_them(engine) -> None:
    """The prompt's blocks are cached by a first request; one asking for prompt logprobs
    computes from position 0 all the same (a cached block keeps K/V, not logits), and a
    later one that does not ask takes the hit."""
    engine.kv.pool.reset_prefix_cache()
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    plain = _run(engine, PROMPT, greedy)
    before = engine.num_computed_tokens_total
    asked = _run(engine, PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                prompt_logprobs=0))
    assert engine.num_computed_tokens_total - before == len(PROMPT) + 1
    assert asked[0].num_cached_tokens == 0
    _check(engine, PROMPT, asked[0].prompt_logprobs, 0)
    assert [t for o in asked for t in o.new_token_ids] == \
        [t for o in plain for t in o.new_token_ids]
    assert all(o.prompt_logprobs is None for o in asked[1:])  # the first output only
    again = _run(engine, PROMPT, greedy)
    assert again[0].num_cached_tokens == 3 * 16 and again[0].prompt_logprobs is None
    engine.leak_check()


def test_batch_mates_that_do_not_ask_are_unchanged(engine) -> None:
    """Two prompts in one batch, one asking: the other's tokens are those it makes alone,
    and it carries no prompt logprobs."""
    other = [5 + (i * 11) % 80 for i in range(20)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = engine.generate([other], greedy)[0].token_ids
    engine.kv.pool.reset_prefix_cache()
    a = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0,
                                                  prompt_logprobs=2))
    b = engine.add_request(other, greedy)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    mine = [o for o in outs if o.request_id == a]
    assert mine[0].new_token_ids and mine[0].finish_reason is FinishReason.LENGTH
    _check(engine, PROMPT, mine[0].prompt_logprobs, 2)
    theirs = [o for o in outs if o.request_id == b]
    assert [t for o in theirs for t in o.new_token_ids] == alone
    assert all(o.prompt_logprobs is None for o in theirs)
    engine.leak_check()


@pytest.mark.parametrize("field,value", [("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                         ("max_tokens", -1)])
def test_bad_values_name_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
