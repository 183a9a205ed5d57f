"""The sampler's per-request token rules (engine/sampling/rules.py): logit_bias,
allowed_token_ids, bad words and min_tokens change exactly the tokens their
definitions say, row by row; SamplingParams refuses their bad values by field."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from engine.sampling import Sampler, SamplingState

V = 32
EOS = 0


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _state(output: list[int] = (), **kw: object) -> SamplingState:
    s = SamplingState(SamplingParams(temperature=0, **kw))
    s.eos_token_ids = (EOS,)
    for t in output:
        s.append(t)
    return s


def _greedy(logits: torch.Tensor, *states: SamplingState) -> list[int]:
    return Sampler(seed=0)(logits, list(states)).token_ids


def test_logit_bias_minus_100_bans_the_greedy_choice_and_plus_100_forces() -> None:
    x = _logits(1)
    best = int(x[0].argmax())
    second = int(x[0].topk(2).indices[1])
    assert _greedy(x, _state(logit_bias={best: -100})) == [second]
    assert _greedy(x, _state(logit_bias={7: 100})) == [7]
    assert _greedy(x, _state()) == [best]  # the caller's logits are untouched


def test_allowed_token_ids_restrict_every_row_that_asks_only() -> None:
    x = _logits(2, seed=3)
    allowed = (4, 9, 17)
    got = _greedy(x, _state(allowed_token_ids=allowed), _state())
    assert got[0] == max(allowed, key=lambda t: float(x[0, t]))
    assert got[1] == int(x[1].argmax())
    sampler = Sampler(seed=1)  # sampled, not greedy: still inside the set, every draw
    s = SamplingState(SamplingParams(temperature=2.0, allowed_token_ids=allowed))
    assert {sampler(x[:1], [s]).token_ids[0] for _ in range(50)} <= set(allowed)


def test_bad_words_one_token_everywhere_longer_ones_only_to_complete() -> None:
    x = _logits(1, seed=5)
    best = int(x[0].argmax())
    assert _greedy(x, _state(bad_words_token_ids=[[best]])) != [best]
    # a two-token word: its last token is banned right after its first, not elsewhere
    word = [11, best]
    assert _greedy(x, _state(output=[3, 11], bad_words_token_ids=[word])) != [best]
    assert _greedy(x, _state(output=[3, 12], bad_words_token_ids=[word])) == [best]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    x = _logits(1)
    x[0, EOS] = 50.0  # EOS is the greedy choice
    x[0, 5] = 40.0  # then the stop token id
    rule = dict(min_tokens=3, stop_token_ids=[5])
    second_best = int(torch.cat([x[0, 1:5], x[0, 6:]]).argmax())
    second_best += 1 if second_best < 4 else 2
    assert _greedy(x, _state(output=[1, 2], **rule)) == [second_best]
    assert _greedy(x, _state(output=[1, 2, 3], **rule)) == [EOS]


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={3: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words"), (dict(min_tokens=17), "min_tokens"),
])
def test_bad_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(max_tokens=16, **kw)
    assert e.value.field == field


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={V: 1}), "logit_bias"), (dict(allowed_token_ids=[1, V]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[1, V + 4]]), "bad_words"),
])
def test_ids_outside_the_vocabulary_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: token id") as e:
        SamplingParams(**kw).check_vocab(V)
    assert e.value.field == field
