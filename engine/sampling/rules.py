"""Per-request token rules: logit_bias, allowed_token_ids, bad words, min_tokens.

Each rule reads one request's history (its output so far) and touches only its own
row, so a row's result never depends on its batch mates. Applied to the sampler's
float32 copy before penalties, temperature and truncation; logprobs stay those of
the raw model (engine/sampling/sampler.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from core.sampling.params import SamplingParams

_NEG_INF = float("-inf")


class RuleState(Protocol):
    """What the rules read of a request (engine/sampling/sampler.py SamplingState)."""

    params: SamplingParams
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]

    def rule_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]: ...


def apply_token_rules_(x: torch.Tensor, states: Sequence[RuleState]) -> None:
    """x: [B, V] float32, one row per state; rows without rules are left as they are."""
    for i, s in enumerate(states):
        p = s.params
        if not p.has_token_rules:
            continue
        row = x[i]
        if p.logit_bias:
            ids, bias = s.rule_tensors(row.device)
            row.index_add_(0, ids, bias)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
            keep[torch.tensor(p.allowed_token_ids, device=row.device)] = True
            row.masked_fill_(~keep, _NEG_INF)
        banned = _banned_words(p.bad_words_token_ids, s.output_token_ids)
        if len(s.output_token_ids) < p.min_tokens:  # no end before min_tokens
            banned.extend(s.eos_token_ids)
            banned.extend(p.stop_token_ids)
        banned = [t for t in banned if t < row.shape[0]]
        if banned:
            row[torch.tensor(banned, device=row.device)] = _NEG_INF


def _banned_words(words: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """The last token of each word whose other tokens end the output (vLLM's rule: a
    word is never completed; a one-token word is banned everywhere)."""
    out = []
    for w in words:
        head = len(w) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head:]) == w[:-1]):
            out.append(w[-1])
    return out
