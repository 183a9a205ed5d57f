"""Lossless acceptance of point-mass proposals, one position at a time.

Every proposer guesses tokens, not distributions: the draft distribution q at each
position is a point mass on the guess d. Rejection sampling (Leviathan et al.; Chen et
al.) then accepts d with probability min(1, p(d) / q(d)) = p(d), and on rejection
samples the residual normalize(max(p - q, 0)), which is p with d removed. The sampler's
exponential race does exactly that: the token it draws at a position is d with
probability p(d) and, given that it is not d, distributed as p without d. So a
verification draws, position by position, the very token plain decoding would draw there
(same penalties over the same history, same Exp(1) draw from the request's own
generator): it keeps the token while it equals the guess and stops at the first that
does not (that token is the correction) or after the last guess (the bonus token).

A seeded request consumes one draw per emitted token, as without speculation, so its
output is reproducible, identical to plain decoding's for the same seed, and a failover
that replays the outputs (SamplingState.resume) continues the same stream. Greedy rows
take the argmax: exact match.
"""
from __future__ import annotations

import torch

from engine.sampling import Sampler, SamplingState, TokenLogprobs

ACCEPT_ALL = False
"""Test hook: accept every guess whatever the target says (deliberately wrong; the
distribution tests must fail with it)."""


def verify(sampler: Sampler, logits: torch.Tensor, draft: list[int], state: SamplingState,
           banned: torch.Tensor | None = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [k+1, V] fp32 at the last committed token and each guess; draft: the k
    guesses; banned [k+1, V] (a constrained request): what its grammar refuses at each
    position, given the guesses before it. Returns the emitted tokens (the accepted
    guesses, then the target's own token) and their logprobs, exactly as plain decoding
    would report them."""
    p = state.params  # penalties and token rules read the history: position by position
    if p.greedy and not p.needs_penalties and not p.has_token_rules and not ACCEPT_ALL:
        return _verify_greedy(sampler, logits, draft, state, banned)
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    pushed = 0
    try:
        for i in range(len(draft) + 1):
            out = sampler(logits[i:i + 1], [state],  # the history includes tokens so far
                          banned[i:i + 1] if banned is not None else None)
            tok = out.token_ids[0]
            if ACCEPT_ALL and i < len(draft):
                tok = draft[i]
                out = sampler.logprobs_of(logits[i:i + 1], [tok], [state])
            tokens.append(tok)
            logprobs.append(out.logprobs[0])
            if i == len(draft) or tok != draft[i]:
                break
            state.output_token_ids.append(tok)  # seen by the next position's penalties
            pushed += 1
    finally:  # the engine commits the tokens it keeps (OutputProcessor.append)
        del state.output_token_ids[len(state.output_token_ids) - pushed:]
    return tokens, logprobs


def _verify_greedy(sampler: Sampler, logits: torch.Tensor, draft: list[int],
                   state: SamplingState, banned: torch.Tensor | None
                   ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Argmax of every position at once (under its mask); keep them up to the first that
    differs from its guess. Logprobs are the raw model's, as plain decoding reports."""
    x = logits if banned is None else logits.masked_fill(banned.to(logits.device), float("-inf"))
    best = x.argmax(dim=1).tolist()
    n = next((i for i, d in enumerate(draft) if best[i] != d), len(draft)) + 1
    tokens = best[:n]
    out = sampler.logprobs_of(logits[:n], tokens, [state] * n)
    return tokens, out.logprobs
