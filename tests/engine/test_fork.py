"""n > 1 on shared blocks (engine/fork.py): one prefill, the choices fork the prompt's
blocks copy-on-write, each draws from its own seeded stream; preemption (swap and
recompute) and abort work per choice; every test ends with a leak check."""
from __future__ import annotations

from collections import defaultdict

import pytest

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.kv_cache.manager import NULL_BLOCK
from engine.llm_engine import LLMEngine
from engine.request import FinishReason

PROMPT = [(j * 7) % 300 + 3 for j in range(20)]  # 20 tokens: one full block of 16 + 4


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat(model=str(model_dir), dtype="float32",
                                            max_model_len=128, **kw))


def _run(eng: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
         each_step=None) -> dict[tuple[str, int], list[int]]:
    """Every choice's tokens by (request id, index); each_step(eng) after every step."""
    for rid, prompt, params in requests:
        eng.add_request(prompt, params, request_id=rid)
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    reasons = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[(o.request_id, o.index)].extend(o.new_token_ids)
            if o.finished:
                reasons[(o.request_id, o.index)] = o.finish_reason
        if each_step is not None:
            each_step(eng)
    assert set(reasons) == set(out)
    return dict(out)


def _in_use(eng: LLMEngine) -> int:
    return sum(1 for b in eng.kv.pool.blocks if b.ref_cnt > 0)


def test_four_seeded_choices_distinct_reproducible_on_one_prompts_blocks(flat_model_dir) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=4, ignore_eos=True)
    eng = _engine(flat_model_dir)  # nearly flat logits: the choices part at once
    bs = eng.kv.block_size
    shared = len(PROMPT) // bs  # the prompt's full blocks: held once by all four
    seen = []

    def check(e: LLMEngine) -> None:
        reqs = [r for r in e.requests.values() if r.stream_id == "a"]
        if len(reqs) < 4:
            return
        tables = [e.kv.tables[r.request_id] for r in reqs]
        assert all(t[:shared] == tables[0][:shared] for t in tables)  # one prompt
        own = [b for t in tables for b in t[shared:] if b != NULL_BLOCK]
        assert _in_use(e) == shared + len(set(own))
        if all(r.num_output_tokens > 1 for r in reqs):  # each has written: copied
            assert len(own) == len(set(own))
            seen.append(_in_use(e))

    first = _run(eng, [("a", PROMPT, params)], check)
    assert len(seen) > 10 and max(seen) == shared + 4 * 2  # 20 + 24 tokens: 3 blocks each
    eng.leak_check()
    choices = [first[("a", j)] for j in range(4)]
    assert all(len(c) == 24 for c in choices)
    assert len({tuple(c) for c in choices}) == 4
    assert _run(eng, [("a", PROMPT, params)]) == first  # reproducible
    one = _run(eng, [("b", PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=7,
                                                   ignore_eos=True))])
    assert one[("b", 0)] == choices[0]  # choice 0 is the request with n = 1
    eng.leak_check()


def test_three_greedy_choices_equal_n1(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir)
    out = _run(eng, [("g", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, n=3,
                                                  ignore_eos=True))])
    one = _run(eng, [("h", PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True))])
    assert out == {("g", j): one[("h", 0)] for j in range(3)}
    eng.leak_check()


def _mixed() -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(3):
        prompt = [(i * 13 + j * 7) % 300 + 3 for j in range(20)]
        out.append((f"m{i}", prompt, SamplingParams(
            max_tokens=40, ignore_eos=True, n=3, temperature=0.0 if i == 1 else 0.9,
            seed=None if i == 1 else 50 + i)))
    return out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_forks_give_the_unconstrained_outputs(flat_model_dir, mode) -> None:
    alone = _run(_engine(flat_model_dir, num_kv_blocks=256), _mixed())
    eng = _engine(flat_model_dir, num_kv_blocks=16, preemption_mode=mode,
                  swap_space=0.01 if mode == "swap" else 0.0)
    assert _run(eng, _mixed()) == alone  # 9 sequences of 4 blocks in a 16-block pool
    assert sum(eng.stats.preemptions.values()) > 0
    if mode == "swap":
        assert eng.stats.swap_out_bytes > 0
    eng.leak_check()


def test_abort_ends_every_choice_and_frees_their_blocks(flat_model_dir) -> None:
    eng = _engine(flat_model_dir)
    eng.add_request(PROMPT, SamplingParams(max_tokens=50, n=4, seed=1, ignore_eos=True),
                    request_id="x")
    for _ in range(5):
        eng.step()
    assert eng.has_request("x") and len(eng.requests) == 4
    outs = eng.abort_request("x")
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    assert all(o.request_id == "x" and o.finish_reason is FinishReason.ABORT for o in outs)
    assert not eng.has_request("x") and eng.abort_request("x") == []
    eng.leak_check()


def test_choice_zero_ended_abort_still_finds_the_others(flat_model_dir) -> None:
    """Choice 0 ends first (its own max_tokens via a stop id would differ per choice, so
    finish it by hand): the request's id still reaches its other choices."""
    eng = _engine(flat_model_dir)
    eng.add_request(PROMPT, SamplingParams(max_tokens=50, n=2, seed=3, ignore_eos=True),
                    request_id="y")
    for _ in range(3):
        eng.step()
    eng._finish(eng.requests["y"], FinishReason.STOP)
    assert eng.has_request("y")
    outs = eng.abort_request("y")
    assert [o.index for o in outs] == [1]
    eng.leak_check()


def test_speculated_choices_equal_plain_ones(flat_model_dir) -> None:
    """n-gram speculation per choice (a repetitive prompt, greedy and seeded choices):
    the same tokens as without it (verification keeps sampling exact)."""
    prompt = [5, 6, 7, 8] * 6
    reqs = [("s", prompt, SamplingParams(max_tokens=20, n=3, seed=9, ignore_eos=True)),
            ("t", prompt, SamplingParams(max_tokens=20, n=2, temperature=0.0,
                                         ignore_eos=True))]
    plain = _run(_engine(flat_model_dir), reqs)
    eng = _engine(flat_model_dir, speculative_method="ngram")
    assert _run(eng, reqs) == plain
    eng.leak_check()


def test_each_choice_keeps_its_constraint(flat_model_dir) -> None:
    from core.guided.spec import GuidedSpec

    eng = _engine(flat_model_dir)
    out = _run(eng, [("c", PROMPT, SamplingParams(max_tokens=12, n=4, seed=2,
                                                  guided=GuidedSpec("regex", "[a-e]{3}-[0-9]{2}")))])
    texts = {eng.tokenizer.decode(t) for t in out.values()}
    assert len(out) == 4 and all(len(t) == 6 and t[3] == "-" for t in texts)
    eng.leak_check()
