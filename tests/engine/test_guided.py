"""Constrained decoding in the colocated engine, on the flat tiny model (it samples
all over what a grammar allows, so a grammar that leaks shows up): every output of
every schema validates, greedy and seeded; regexes and choices always match;
unconstrained batch mates are untouched; max_tokens cutting a grammar short is
"length"; the grammar survives a resume and preemption; bad constraints are refused
before anything is queued."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from core.guided.spec import GuidedSpec
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from core.sampling import SamplingParams
from tests.guided_cases import (CHOICES, MAX_TOKENS, REGEXES, SCHEMAS, assert_matches,
                                assert_valid)


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32",
                                            **{"num_kv_blocks": 512, "max_model_len": 1024, **kw}))


@pytest.fixture(scope="module")
def eng(flat_model_dir) -> LLMEngine:
    return _engine(flat_model_dir)


def _params(spec: GuidedSpec, seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), guided=spec,
                          temperature=1.0 if seed is not None else 0.0, seed=seed, **kw)


@pytest.mark.parametrize("seed", [None, 11, 12])
def test_every_schema_output_validates(eng, seed) -> None:
    names = list(SCHEMAS)
    params = [_params(GuidedSpec.json_schema(SCHEMAS[n]), None if seed is None else seed + i)
              for i, n in enumerate(names)]
    params += [SamplingParams(max_tokens=20, ignore_eos=True)]  # an unconstrained batch mate
    outs = eng.generate([[5, 6, i + 7] for i in range(len(params))], params)
    for name, out in zip(names, outs):
        assert out.finish_reason is FinishReason.STOP, (name, out.text)
        assert_valid(name, out.text)
    assert len(outs[-1].token_ids) == 20
    eng.leak_check()


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_regex_and_choice_outputs_always_match(eng, seed) -> None:
    specs = [GuidedSpec("regex", r) for r in REGEXES] + [GuidedSpec.choice(c) for c in CHOICES]
    outs = eng.generate([[9, i + 3] for i in range(len(specs))],
                        [_params(s, None if seed is None else seed * 100 + i)
                         for i, s in enumerate(specs)])
    for spec, out in zip(specs, outs):
        assert out.finish_reason is FinishReason.STOP, (spec, out.text)
        if spec.kind == "regex":
            assert_matches(spec.text, out.text)
        else:
            assert out.text in CHOICES[specs.index(spec) - len(REGEXES)]
    eng.leak_check()


def test_unconstrained_rows_pay_nothing_and_are_untouched(flat_model_dir) -> None:
    eng = _engine(flat_model_dir)
    free = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=5)]
    alone = [o.token_ids for o in eng.generate([[4, 5], [6, 7]], free)]
    assert eng.runner._masks is None  # no constrained row yet: llguidance never ran
    spec = GuidedSpec.json_schema(SCHEMAS["flat_object"])
    mixed = eng.generate([[4, 5], [6, 7], [8, 9]], free + [_params(spec, 3)])
    assert [o.token_ids for o in mixed[:2]] == alone
    assert_valid("flat_object", mixed[2].text)
    assert max(eng.runner.masks.stats.rows) == 1  # only the constrained row was masked
    eng.leak_check()


def test_max_tokens_cutting_a_grammar_short_is_length(eng) -> None:
    spec = GuidedSpec("regex", "[a-z]{10}")
    prefix = eng.tokenizer.encode("abc", add_special_tokens=False)
    req = eng.make_request([5, 6], _params(spec, 1, max_tokens=len(prefix) + 1),
                           output_token_ids=prefix)  # resumed: 7 letters still owed
    eng.admit(req)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH]
    eng.leak_check()


def test_a_resumed_request_rebuilds_its_grammar(eng) -> None:
    spec = GuidedSpec.json_schema(SCHEMAS["array_of_objects"])
    full = eng.generate([[3, 4, 5]], _params(spec, 77))[0]
    assert_valid("array_of_objects", full.text)
    k = len(full.token_ids) // 2
    req = eng.make_request([3, 4, 5], _params(spec, 77), output_token_ids=full.token_ids[:k])
    eng.admit(req)
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == full.token_ids  # same grammar state, same RNG draws
    eng.leak_check()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_every_grammar(flat_model_dir, mode) -> None:
    names = list(SCHEMAS)[:10]
    reqs = [([(i * 13 + j * 7) % 300 + 3 for j in range(40)],
             _params(GuidedSpec.json_schema(SCHEMAS[n]), 200 + i if i % 2 else None))
            for i, n in enumerate(names)]
    ref = _engine(flat_model_dir)
    alone = [ref.generate([p], sp)[0].token_ids for p, sp in reqs]
    eng = _engine(flat_model_dir, num_kv_blocks=16, max_model_len=256, preemption_mode=mode,
                  swap_space=0.01 if mode == "swap" else 0.0)
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert sum(eng.stats.preemptions.values()) > 0
    assert [o.token_ids for o in outs] == alone
    for name, out in zip(names, outs):
        assert_valid(name, out.text)
    eng.leak_check()


def test_stop_strings_end_a_constrained_output_only_where_it_is_complete(eng) -> None:
    inside = eng.generate([[5]], _params(GuidedSpec("regex", "abc-def-ghi"), None,
                                         stop=("-",)))[0]
    assert (inside.text, inside.finish_reason) == ("abc-def-ghi", FinishReason.STOP)
    after = eng.generate([[5]], _params(GuidedSpec("regex", "abc(-def)?"), None,
                                        stop=("-",)))[0]
    assert (after.text, after.finish_reason) == ("abc", FinishReason.STOP)
    eng.leak_check()


def test_bad_constraints_are_refused_before_queueing(eng) -> None:
    cases = [(GuidedSpec("regex", "(a"), 50, "guided: .*unclosed group"),
             (GuidedSpec("regex", "(?=a)b"), 50, "guided: .*look-around"),
             (GuidedSpec("json_schema", '{"type": "nope"}'), 50, "guided: .*JSON Schema"),
             (GuidedSpec("json_schema", "{not json"), 50, "guided: .*not valid JSON"),
             (GuidedSpec("grammar", "start: missing_rule"), 50, "guided: .*missing_rule"),
             (GuidedSpec.choice([]), 50, "guided: .*non-empty list"),
             (GuidedSpec.json_schema(SCHEMAS["nested_object"]), 5, "max_tokens: 5 is too few")]
    for spec, max_tokens, match in cases:
        with pytest.raises(ValueError, match="(?s)" + match):
            eng.make_request([5, 6], _params(spec, None, max_tokens=max_tokens))
    bad = eng.tokenizer.encode("xyz", add_special_tokens=False)
    with pytest.raises(ValueError, match="output_token_ids"):
        eng.make_request([5, 6], _params(GuidedSpec("regex", "[0-9]+"), None),
                         output_token_ids=bad)
    with pytest.raises(ValueError, match="guided.kind"):
        GuidedSpec("xml", "<a/>")
    assert not eng.requests
    eng.leak_check()
