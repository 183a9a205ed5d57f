"""Speculative decoding and constrained decoding in one engine: a constrained request
never speculates (its tokens are sampled under its grammar's masks), so its output
validates and equals the one a plain engine gives; unconstrained batch mates still
speculate and stay token-identical; nothing is left behind."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.guided.spec import GuidedSpec
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from engine.sampling import SamplingParams
from tests.guided_cases import MAX_TOKENS, SCHEMAS, assert_valid


def _engine(model_dir, method: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=1024,
                                  num_kv_blocks=512, speculative_method=method,
                                  speculative_max_batch=0))


@pytest.mark.parametrize("seed", [None, 5])
def test_constrained_rows_beside_speculating_rows(flat_model_dir, seed) -> None:
    names = list(SCHEMAS)[:6]
    repeat = [9, 10, 11, 12, 13, 14] * 4  # the n-gram proposer finds matches here
    prompts = [[5, 6, i + 7] for i in range(len(names))] + [repeat, repeat[:-3]]
    params = [SamplingParams(max_tokens=MAX_TOKENS, guided=GuidedSpec.json_schema(SCHEMAS[n]),
                             temperature=0.0 if seed is None else 1.0,
                             seed=None if seed is None else seed + i)
              for i, n in enumerate(names)]
    params += [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)] * 2
    plain = _engine(flat_model_dir, "none").generate(prompts, params)
    spec = _engine(flat_model_dir, "ngram")
    outs = spec.generate(prompts, params)
    for name, out in zip(names, outs):
        assert out.finish_reason is FinishReason.STOP, (name, out.text)
        assert_valid(name, out.text)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.speculator.counters.get("ngram")
    assert stats.verifications > 0 and stats.accepted > 0  # the free rows did speculate
    spec.leak_check()
