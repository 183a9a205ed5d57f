"""Sampler and SamplingParams: validation, truncation, penalties, seeding, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import Sampler, SamplingState, TokenLogprobs, apply_penalties
from core.sampling import SamplingParams

V = 32


def _states(n: int, **kw: object) -> list[SamplingState]:
    return [SamplingState(SamplingParams(**kw)) for _ in range(n)]


def _logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- params

@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("temperature", -0.1), ("temperature", 2.5), ("top_k", -1),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.1), ("presence_penalty", 2.1),
    ("frequency_penalty", -2.1), ("seed", -1), ("seed", 2**63), ("logprobs", 21),
    ("logprobs", -1), ("max_tokens", 1.5), ("top_k", True), ("temperature", float("nan")),
])
def test_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_validation_message_gives_range() -> None:
    with pytest.raises(ValueError, match=r"max_tokens must be >= 0, got -1"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\], got 3"):
        SamplingParams(temperature=3)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)


def test_params_lists_become_tuples_and_greedy() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2], temperature=0)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (1, 2)
    assert p.greedy and not SamplingParams().greedy
    assert SamplingParams(stop="x").stop == ("x",)
    hash(p)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-3])


# ---------------------------------------------------------------- truncation

def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = _logits(6).to(torch.bfloat16)
    before = logits.clone()
    out = Sampler(seed=0)(logits, _states(6, temperature=0))
    assert out.token_ids == logits.float().argmax(dim=1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_fp32_logits_are_untouched_by_every_kind_of_row() -> None:
    """fp32 logits (which the sampler reads without a copy when no row has rules or
    penalties): greedy rows, temperature with top-k / top-p / min-p, and logprobs leave
    the caller's tensor as it was, and the logprobs are the raw model's."""
    logits = _logits(6, seed=3)
    before = logits.clone()
    states = [SamplingState(SamplingParams(temperature=0, logprobs=2)),
              SamplingState(SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=1)),
              SamplingState(SamplingParams(temperature=1.3, top_p=0.8, seed=2)),
              SamplingState(SamplingParams(temperature=0.5, min_p=0.1, seed=3)),
              SamplingState(SamplingParams(temperature=0)),
              SamplingState(SamplingParams(temperature=2.0, seed=4, logprobs=0))]
    out = Sampler(seed=0)(logits, states)
    assert torch.equal(logits, before)
    states[4] = SamplingState(SamplingParams(temperature=0, logit_bias={7: 50.0},
                                             repetition_penalty=1.5), prompt_token_ids=[1, 2])
    out = Sampler(seed=0)(logits, states)  # a row with rules and penalties: on a copy
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before, dim=1)
    for i in (0, 1, 5):
        assert out.logprobs[i].logprob == pytest.approx(float(raw[i, out.token_ids[i]]))
    assert out.token_ids[0] == int(before[0].argmax()) and out.token_ids[4] == 7


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(8, seed=1)
    states = [SamplingState(SamplingParams(top_k=1, seed=i if i % 2 else None)) for i in range(8)]
    for _ in range(5):
        assert Sampler()(logits, states).token_ids == logits.argmax(dim=1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(8, seed=2)
    states = _states(8, top_p=1e-6, temperature=1.5)
    for _ in range(5):
        assert Sampler()(logits, states).token_ids == logits.argmax(dim=1).tolist()


def test_top_k_keeps_only_k_best() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    out = Sampler(seed=0)(logits, _states(2000, top_k=2))
    assert set(out.token_ids) == {2, 3}


def test_top_p_keeps_nucleus() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    out = Sampler(seed=0)(logits, _states(2000, top_p=0.7))  # 0.5 < 0.7 <= 0.8
    assert set(out.token_ids) == {0, 1}


def test_min_p_masks_unlikely_tokens() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    out = Sampler(seed=0)(logits, _states(2000, min_p=0.2))  # threshold 0.1
    assert set(out.token_ids) == {0, 1, 2}
    out = Sampler(seed=0)(logits, _states(2000, min_p=0.7))  # threshold 0.35
    assert set(out.token_ids) == {0}


def test_mixed_batch_features_are_per_row() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4, 1)
    kinds = [dict(temperature=0), dict(top_k=1), dict(top_p=0.01), dict(min_p=0.99)]
    params = [SamplingParams(**kinds[i % 4]) for i in range(400)]
    all_logits = logits.repeat(100, 1)
    out = Sampler(seed=0)(all_logits, [SamplingState(p) for p in params])
    assert set(out.token_ids) == {0}
    free = Sampler(seed=0)(all_logits, _states(400))
    assert len(set(free.token_ids)) == 4


# ---------------------------------------------------------------- penalties

def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    st = SamplingState(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1])
    st.append(3)
    got = apply_penalties(logits, [st])
    assert torch.equal(got, torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5]]))


def test_presence_frequency_exact_and_output_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    st = SamplingState(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                       prompt_token_ids=[3, 3, 3])
    for t in (0, 0, 0, 1):
        st.append(t)
    got = apply_penalties(logits, [st])
    # token 0: 1 - 0.5 - 3*0.25 ; token 1: 1 - 0.5 - 0.25 ; prompt token 3 untouched
    assert torch.allclose(got, torch.tensor([[-0.25, 0.25, 1.0, 1.0]]))


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = _logits(3, v=6)
    plain = SamplingState(SamplingParams(), prompt_token_ids=[0, 1, 2])
    pen = SamplingState(SamplingParams(repetition_penalty=1.5, frequency_penalty=-1.0),
                        prompt_token_ids=[4])
    pen.append(5)
    got = apply_penalties(logits, [plain, pen, plain])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    x = logits[1].clone()
    x[4] = x[4] / 1.5 if x[4] > 0 else x[4] * 1.5
    x[5] = (x[5] / 1.5 if x[5] > 0 else x[5] * 1.5) + 1.0
    assert torch.allclose(got[1], x)


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    st = SamplingState(SamplingParams(temperature=0, presence_penalty=1.0))
    assert Sampler()(logits, [st]).token_ids == [0]
    st.append(0)
    assert Sampler()(logits, [st]).token_ids == [1]


# ---------------------------------------------------------------- reproducibility

_TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(123)) * 2


def _toy_model(states: list[SamplingState]) -> torch.Tensor:
    """Logits depending only on each request's own history."""
    rows = []
    for s in states:
        hist = list(s.prompt_token_ids) + s.output_token_ids
        rows.append(_TABLE[hist[-1]] + 0.1 * len(hist))
    return torch.stack(rows)


def _run(states: list[SamplingState], steps: int, sampler: Sampler) -> None:
    for _ in range(steps):
        out = sampler(_toy_model(states), states)
        for s, t in zip(states, out.token_ids):
            s.append(t)


def _target() -> SamplingState:
    return SamplingState(SamplingParams(seed=42, temperature=1.3, top_p=0.9, top_k=20,
                                        repetition_penalty=1.2, presence_penalty=0.3),
                         prompt_token_ids=[1, 2, 3])


@pytest.mark.parametrize("row", [0, 3, 7])
def test_seeded_request_independent_of_batch(row: int) -> None:
    alone = _target()
    _run([alone], 20, Sampler(seed=1))
    mates = [SamplingState(SamplingParams(seed=s if s % 2 else None, temperature=0.7 + 0.1 * s,
                                          min_p=0.05 * (s % 3), frequency_penalty=0.2),
                           prompt_token_ids=[s]) for s in range(6)]
    mates.append(SamplingState(SamplingParams(temperature=0), prompt_token_ids=[9]))
    batch = mates[:row] + [_target()] + mates[row:]
    _run(batch, 20, Sampler(seed=99))
    assert batch[row].output_token_ids == alone.output_token_ids


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    def gen(seed: int) -> list[int]:
        st = SamplingState(SamplingParams(seed=seed), prompt_token_ids=[0])
        _run([st], 20, Sampler())
        return st.output_token_ids
    assert gen(5) == gen(5)
    assert gen(5) != gen(6)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("seeded", [False, True])
def test_distribution_matches_probabilities(temperature: float, seeded: bool) -> None:
    n = 20_000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = p.log().unsqueeze(0).expand(n, 4)
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None)
              for i in range(n)]
    out = Sampler(seed=7)(logits, [SamplingState(q) for q in params])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    want = (p ** (1 / temperature)) / (p ** (1 / temperature)).sum()
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3, seed=5)
    st = [SamplingState(SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5),
                        prompt_token_ids=[0, 1, 2]),
          SamplingState(SamplingParams(logprobs=0, temperature=0)),
          SamplingState(SamplingParams())]
    out = Sampler(seed=0)(logits, st)
    ref = torch.log_softmax(logits, dim=1)
    lp0, lp1, lp2 = out.logprobs
    assert isinstance(lp0, TokenLogprobs) and isinstance(lp1, TokenLogprobs) and lp2 is None
    assert lp0.token_id == out.token_ids[0]
    assert math.isclose(lp0.logprob, ref[0, lp0.token_id].item(), rel_tol=1e-6)
    vals, ids = ref[0].topk(3)
    assert [t for t, _ in lp0.top] == ids.tolist()
    assert all(math.isclose(v, w, rel_tol=1e-6) for (_, v), w in zip(lp0.top, vals.tolist()))
    assert lp1.top == [] and lp1.token_id == logits[1].argmax().item()
    assert math.isclose(lp1.logprob, ref[1].max().item(), rel_tol=1e-6)


def test_shape_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="len\\(states\\)"):
        Sampler()(torch.zeros(2, 4), _states(3))
    out = Sampler()(torch.zeros(0, 4), [])
    assert out.token_ids == [] and out.logprobs == []
