"""Speculative decoding and constrained decoding in one engine: a constrained request
speculates too, its guesses cut before the first its grammar refuses and each verified
position sampled under the grammar's mask there, so its output validates and equals the
one a plain engine gives; unconstrained batch mates stay token-identical; nothing is
left behind."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from core.guided.spec import GuidedSpec
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from core.sampling import SamplingParams
from tests.guided_cases import MAX_TOKENS, SCHEMAS, assert_valid


def _engine(model_dir, method: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32", max_model_len=1024,
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
    assert stats.verifications > 0 and stats.accepted > 0
    spec.leak_check()


@pytest.mark.parametrize("seed", [None, 3])
def test_constrained_rows_speculate_under_their_grammar(flat_model_dir, monkeypatch,
                                                        seed) -> None:
    """Guesses that continue the plain output and then turn to tokens the grammar
    refuses: the refused tail is cut before verification, every verified guess is one
    the grammar allows, the verify pass gets a mask per position, and the output equals
    plain decoding's."""
    import engine.model_runner as mr

    names = list(SCHEMAS)[:6]
    prompts = [[5, 6, i + 7] for i in range(len(names))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, guided=GuidedSpec.json_schema(SCHEMAS[n]),
                             temperature=0.0 if seed is None else 1.0,
                             seed=None if seed is None else seed + i)
              for i, n in enumerate(names)]
    want = {tuple(p): o.token_ids for p, o in
            zip(prompts, _engine(flat_model_dir, "none").generate(prompts, params))}
    spec = _engine(flat_model_dir, "ngram")
    junk = spec.tokenizer.encode("}}}}", add_special_tokens=False)  # refused mid-value
    offered, verified = [0], [0]

    def oracle(reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            cont = want[tuple(r.prompt_token_ids)][r.num_output_tokens:][:max(1, k - 2)]
            out.append((cont + junk)[:k])
            offered[0] += len(out[-1])
        return out

    real_verify = mr.verify

    def checked(sampler, logits, draft, state, banned=None):
        assert banned is not None and banned.shape[0] == len(draft) + 1
        assert state.guide.matcher.validate_tokens(draft) == len(draft)
        verified[0] += len(draft)
        return real_verify(sampler, logits, draft, state, banned)

    monkeypatch.setattr(spec.speculator.proposer, "propose", oracle)
    monkeypatch.setattr(mr, "verify", checked)
    outs = spec.generate(prompts, params)
    for name, out in zip(names, outs):
        assert_valid(name, out.text)
    assert [o.token_ids for o in outs] == [want[tuple(p)] for p in prompts]
    assert 0 < verified[0] < offered[0]  # constrained rows speculated; refused tails cut
    assert spec.speculator.counters.get("ngram").accepted > 0
    spec.leak_check()


def test_the_tokens_a_grammar_forces_are_guessed(flat_model_dir, monkeypatch) -> None:
    """A proposer with no guess: a constrained request still guesses what its grammar
    forces (a schema's keys and punctuation), which the target can only accept."""
    names = ["flat_object", "nested_object", "deep_nesting"]
    prompts = [[5, 6, i + 7] for i in range(len(names))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                             guided=GuidedSpec.json_schema(SCHEMAS[n])) for n in names]
    want = [o.token_ids for o in _engine(flat_model_dir, "none").generate(prompts, params)]
    spec = _engine(flat_model_dir, "ngram")
    monkeypatch.setattr(spec.speculator.proposer, "propose", lambda reqs, ks: [[] for _ in reqs])
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    for name, out in zip(names, outs):
        assert_valid(name, out.text)
    stats = spec.speculator.counters.get("ngram")
    assert stats.accepted > 0 and stats.accepted >= stats.proposed // 2
    spec.leak_check()


@pytest.mark.parametrize("draft", ["self:1", "separate"])
def test_constrained_rows_with_a_draft_model(flat_model_dir, tmp_path, draft) -> None:
    """An in-step proposer (a draft model) guesses into reserved slots before the grammar
    cuts its guesses: outputs still equal plain decoding's and validate, nothing leaks."""
    from tests.utils import make_tiny_llama

    names = ["flat_object", "bounded_int_array", "array_of_objects"]
    prompts = [[5, 6, i + 7] for i in range(len(names))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                             guided=GuidedSpec.json_schema(SCHEMAS[n])) for n in names]
    want = [o.token_ids for o in _engine(flat_model_dir, "none").generate(prompts, params)]
    model = "self:1" if draft == "self:1" else str(make_tiny_llama(
        tmp_path / "draft", layers=1, seed=1, embed_scale=0.02, max_pos=2048))
    eng = LLMEngine(EngineConfig.from_flat(model=str(flat_model_dir), dtype="float32", max_model_len=1024,
                                           num_kv_blocks=512, speculative_method="draft",
                                           speculative_model=model, speculative_max_batch=0))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    for name, out in zip(names, outs):
        assert_valid(name, out.text)
    assert eng.speculator.counters.get(eng.speculator.proposer.name).verifications > 0
    eng.leak_check()
