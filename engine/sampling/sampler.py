"""Batched token sampler: one call per engine step for the whole batch.

Order: token rules (logit_bias, allowed tokens, bad words, min_tokens) -> penalties
-> greedy argmax -> temperature -> top-k/top-p -> min-p -> draw.
The draw is Gumbel-max in its exponential form, argmax(probs / q) with
q ~ Exp(1), which picks token i with probability probs[i]. A seeded request
draws its q from its own generator and every transform is row-wise, so its
tokens do not depend on which requests share the batch or on its row.

A constrained request's row is first masked to the tokens its grammar allows
(``banned``, built beside the forward pass by engine/guided/masks.py).

Logprobs are those of the RAW model distribution (log_softmax of the logits
before penalties, temperature and truncation), as vLLM returns by default: they
describe the model, not the sampling knobs, and stay comparable across requests.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.sampling.params import SamplingParams
from engine.sampling.processors import (apply_min_p_, apply_penalties_, apply_temperature_,
                                        apply_top_k_top_p_)
from engine.sampling.rules import apply_token_rules_

if TYPE_CHECKING:
    from core.guided.compiler import GuidedState

_TINY = torch.finfo(torch.float32).tiny


class SamplingState:
    """Mutable per-request state the sampler needs across steps.

    The engine creates one per request and calls ``append`` with every token it
    commits, so penalties see the whole history and the seeded RNG advances
    exactly once per sampling step of this request. A constrained request's ``guide``
    consumes every committed token too, so a resumed request's grammar state is rebuilt
    by replaying its outputs.
    """

    __slots__ = ("params", "prompt_token_ids", "output_token_ids", "guide", "eos_token_ids",
                 "_generator", "_prompt_t", "_bias_t")

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.prompt_token_ids: tuple[int, ...] = tuple(int(t) for t in prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.guide: GuidedState | None = None
        """The grammar state of a constrained request (set by the engine)."""
        self.eos_token_ids: tuple[int, ...] = ()
        """The model's end tokens, masked before min_tokens (set by the engine)."""
        self._generator: torch.Generator | None = None
        self._prompt_t: torch.Tensor | None = None
        self._bias_t: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, token_id: int) -> None:
        """Record a token the engine committed to the output (a token the grammar
        refuses leaves ``guide.error`` set)."""
        self.output_token_ids.append(int(token_id))
        if self.guide is not None:
            self.guide.consume(token_id)

    def resume(self, output_token_ids: Sequence[int], vocab_size: int,
               device: torch.device) -> None:
        """Continue a request another worker started: record its outputs and advance
        a seeded generator past the draws those tokens consumed (one Exp(1) draw of
        vocab_size per sampled token), so the rest matches an uninterrupted run."""
        for t in output_token_ids:
            self.append(t)
        if self.guide is not None and self.guide.error:
            raise ValueError(f"output_token_ids do not match the request's constraint "
                             f"({self.guide.spec.kind}): {self.guide.error}")
        gen = None if self.params.greedy else self.generator(device)
        if gen is not None:
            for _ in output_token_ids:
                torch.empty(vocab_size, device=device).exponential_(generator=gen)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator (created on first use), or None when unseeded."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.params.seed)
        elif self._generator.device != device:
            raise ValueError(f"seeded request moved from {self._generator.device} to {device}")
        return self._generator

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        """Prompt ids as a long tensor, cached: the prompt never changes."""
        if self._prompt_t is None or self._prompt_t.device != device:
            self._prompt_t = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)
        return self._prompt_t

    def rule_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids, biases) tensors, cached: the request's bias is fixed."""
        if self._bias_t is None or self._bias_t[0].device != device:
            bias = self.params.logit_bias
            self._bias_t = (torch.tensor([t for t, _ in bias], dtype=torch.long, device=device),
                            torch.tensor([v for _, v in bias], dtype=torch.float32,
                                         device=device))
        return self._bias_t

    def output_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.output_token_ids, dtype=torch.long, device=device)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top-N alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """(token_id, logprob) pairs, most likely first; empty when N = 0."""


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, plus logprobs for rows that asked (else None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"token_ids ({len(self.token_ids)}) and logprobs "
                             f"({len(self.logprobs)}) must have the same length")


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Penalised float32 copy of ``logits`` (the caller's tensor is left untouched)."""
    x = logits.to(torch.float32, copy=True)
    _penalise_(x, states)
    return x


def _penalise_(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if s.params.needs_penalties]
    if not rows:
        return
    dev = x.device
    sel = [states[i] for i in rows]
    idx = torch.tensor(rows, device=dev)
    sub = x.index_select(0, idx)
    apply_penalties_(
        sub,
        prompt_ids=[s.prompt_tensor(dev) for s in sel],
        output_ids=[s.output_tensor(dev) for s in sel],
        repetition=[s.params.repetition_penalty for s in sel],
        presence=[s.params.presence_penalty for s in sel],
        frequency=[s.params.frequency_penalty for s in sel],
    )
    x.index_copy_(0, idx, sub)


class Sampler:
    """Samples the next token for every request of a batch in one call.

    ``seed`` seeds the generator shared by unseeded requests (tests, benchmarks);
    None seeds it from torch's default RNG.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState],
                 banned: torch.Tensor | None = None) -> SamplerOutput:
        """banned: [B, V] bool, True where a row's grammar refuses the token
        (constrained requests); None when no row is constrained."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [B, V] with B = len(states) = {len(states)}, "
                             f"got shape {tuple(logits.shape)}")
        if not states:
            return SamplerOutput([], [])
        if banned is not None:  # the copy and the mask in one pass
            x = logits.to(torch.float32).masked_fill(banned.to(logits.device, non_blocking=True),
                                                     float("-inf"))
        elif any(_changes_logits(s.params) for s in states):
            x = logits.to(torch.float32, copy=True)
        else:  # greedy rows that change nothing: the argmax of the logits as they are
            x = logits.to(torch.float32)
        apply_token_rules_(x, states)
        _penalise_(x, states)  # a refused token stays -inf whatever the penalties
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rand = [i for i, s in enumerate(states) if not s.params.greedy]
        if not rand:
            token_ids = x.argmax(dim=1).tolist()
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
            if greedy:
                g = torch.tensor(greedy, device=x.device)
                tokens[g] = x.index_select(0, g).argmax(dim=1)
            r = torch.tensor(rand, device=x.device)
            tokens[r] = self._sample(x.index_select(0, r), [states[i] for i in rand])
            token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _logprobs(logits, token_ids, states))

    def logprobs_of(self, logits: torch.Tensor, token_ids: list[int],
                    states: Sequence[SamplingState]) -> SamplerOutput:
        """Given tokens and their raw-model logprobs (rows that asked), no sampling."""
        return SamplerOutput(list(token_ids), _logprobs(logits, token_ids, states))

    def _sample(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, truncation and the exponential-race draw for non-greedy rows."""
        params = [s.params for s in states]
        apply_temperature_(x, [p.temperature for p in params])
        apply_top_k_top_p_(x, [p.top_k for p in params], [p.top_p for p in params])
        apply_min_p_(x, [p.min_p for p in params])
        probs = x.softmax(dim=1)
        q = self._exponential(states, x.shape[1], x.device)
        return (probs / q).argmax(dim=1)

    def _exponential(self, states: list[SamplingState], vocab: int,
                     device: torch.device) -> torch.Tensor:
        """Exp(1) noise [n, V]: one draw per seeded row from its own generator,
        one shared draw for all unseeded rows."""
        q = torch.empty(len(states), vocab, dtype=torch.float32, device=device)
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            noise = torch.empty(len(unseeded), vocab, device=device)
            q.index_copy_(0, idx, noise.exponential_(generator=self._shared_generator(device)))
        for i, s in enumerate(states):
            gen = s.generator(device)
            if gen is not None:
                q[i] = torch.empty(vocab, device=device).exponential_(generator=gen)
        return q.clamp_(min=_TINY)  # Exp(1) may return exactly 0 -> would give 0/0

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def _changes_logits(p) -> bool:
    """True when sampling this row changes its logits in place (rules, penalties): the
    sampler then works on a copy, the raw logits kept for logprobs. (A temperature works
    on the sampled rows' own gathered copy.)"""
    return p.has_token_rules or p.needs_penalties


def _logprobs(logits: torch.Tensor, token_ids: list[int],
              states: Sequence[SamplingState]) -> list[TokenLogprobs | None]:
    """Raw-model logprobs of the chosen token and top-N, for rows that asked."""
    out: list[TokenLogprobs | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    found = token_logprobs(logits.index_select(0, idx), [token_ids[i] for i in rows],
                           [states[i].params.logprobs or 0 for i in rows])
    for i, lp in zip(rows, found):
        out[i] = lp
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   tops: list[int]) -> list[TokenLogprobs]:
    """Per row of logits [N, V]: the raw-model logprob of token_ids[row] and the row's
    tops[row] most likely (token, logprob) pairs (sampled tokens, and prompt tokens)."""
    dev = logits.device
    lp = torch.log_softmax(logits.to(torch.float32), dim=1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=dev).unsqueeze(1)).squeeze(1).tolist()
    n_max = min(max(tops, default=0), lp.shape[1])
    top_v: list[list[float]] = [[] for _ in token_ids]
    top_i: list[list[int]] = [[] for _ in token_ids]
    if n_max > 0:
        vals, ids = lp.topk(n_max, dim=1)
        top_v, top_i = vals.tolist(), ids.tolist()
    return [TokenLogprobs(t, chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
            for j, (t, n) in enumerate(zip(token_ids, tops))]
