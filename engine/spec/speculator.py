"""What the engine calls around each step to speculate (--speculative-method).

Before scheduling, ``prepare`` sets ``Request.draft`` on every decode row that may
speculate this step: none when the step has more decode rows than
--speculative-max-batch, fewer guesses per row the more rows there are (VERIFY_ROWS),
none for a request that opted out (SamplingParams.speculate) or whose recent guesses
were mostly rejected (SpecState), and never more than its max_tokens or the context
window leave room for. "Mostly" is relative to what a guess costs: a draft model's
forward pass must be paid back, so its requests need more acceptance to keep going
(``low``), start at one guess and grow, and start paused while the proposer's recent
guesses, over all requests, fall below it. A constrained request's guesses stop before
the first its grammar refuses and go on with the tokens the grammar forces there; the
runner verifies each position under the grammar's mask there. The scheduler then gives
those rows slots for their guesses; ``fill`` runs an in-step proposer (a draft model) in
those slots; the runner verifies; ``record`` counts what was accepted.
"""
from __future__ import annotations

import logging
from typing import Callable

from engine.config import SpecConfig
from engine.request import Request, RequestStatus
from engine.spec.base import Proposer
from engine.spec.registry import PROPOSERS
from engine.spec.state import LOW_ACCEPTANCE, SpecCounters, SpecState

log = logging.getLogger(__name__)
PENDING = -1
"""Placeholder guess of an in-step proposer between scheduling and ``fill``."""
START_PAUSED = 16
"""Steps a new request waits before its first guess while the proposer's recent
acceptance is below break-even (then a probe; the pause doubles from 32 after a miss)."""
RECENT = 0.1
"""Weight of one verification in the proposer-wide moving acceptance rate."""
VERIFY_ROWS = 32
"""Guesses per request are capped so that a step's decode rows, guesses included, stay
within this many: up to about 32 rows the packed int4 kernel's cost grows little with
the rows (engine/quant/csrc/int4_mm.cpp), beyond it every row costs (1 request: up to
31 guesses; 4: 7; 8: 3)."""


def _guide(req: Request):
    return req.sampling.guide if req.sampling is not None else None


def fit_grammar(req: Request, draft: list[int], k: int) -> list[int]:
    """A constrained request's guesses up to the first its grammar refuses, then the
    tokens the grammar forces after them (keys, punctuation: llguidance's fast-forward
    tokens; the target can only accept them), at most k in all. An unconstrained
    request's guesses as they are."""
    guide = _guide(req)
    if guide is None:
        return draft
    m = guide.matcher
    draft = draft[:m.validate_tokens(draft)] if draft else []
    if len(draft) < k and not m.is_stopped():
        n = len(draft)
        if n:
            m.consume_tokens(draft)
        if not m.is_stopped():
            draft = draft + m.compute_ff_tokens()[:k - n]
        if n:
            m.rollback(n)  # the engine commits what the verify pass accepts
    return draft


class Speculator:
    def __init__(self, config: SpecConfig, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.max_model_len = max_model_len
        self.low = LOW_ACCEPTANCE + proposer.cost
        """Acceptance a request needs to keep speculating (SpecState.low)."""
        self.start_k = self.k if proposer.cost == 0 else 1
        self.rate = 1.0
        """Moving acceptance rate over every request's verifications."""
        self.counters = SpecCounters()
        self.counters.get(proposer.name)  # the series exist from the start

    @classmethod
    def create(cls, config: SpecConfig, runner, tokenizer, max_model_len: int
               ) -> Speculator | None:
        if config.speculative_method == "none":
            return None
        if config.num_speculative_tokens >= max_model_len:
            raise ValueError(f"--num-speculative-tokens {config.num_speculative_tokens} is "
                             f"beyond the context window ({max_model_len} tokens)")
        proposer = PROPOSERS.load(config.speculative_method).create(config, runner, tokenizer)
        spec = cls(config, proposer, max_model_len)
        log.info("speculative decoding: %s, up to %d tokens per step, off above %s decode "
                 "rows; a guess costs %.2f of a step, so a request pauses below %.0f%% "
                 "accepted", proposer.name, spec.k, spec.max_batch or "no limit of",
                 proposer.cost, 100 * spec.low)
        return spec

    def prepare(self, running: list[Request],
                ends_after_prompt: Callable[[Request], bool] = lambda req: False) -> None:
        """Propose tokens for this step's decode rows (Request.draft). A request that
        ends after its prompt (``ends_after_prompt``, KVConnector) gets none: its last
        prompt token may run as a decode row, and it must emit one token only. Nor does
        a request under a bounded KV policy (engine/kv_cache/policy.py)."""
        decodes = []
        for req in running:
            req.draft = []
            if (req.status is RequestStatus.RUNNING and not ends_after_prompt(req)
                    and req.kv_policy is None  # its kept blocks change within a step
                    and len(req.token_ids) - req.num_computed_tokens == 1):
                decodes.append(req)
        if self.max_batch and len(decodes) > self.max_batch:
            return
        cands, ks = [], []
        cap = max(1, VERIFY_ROWS // max(1, len(decodes)) - 1)
        for req in decodes:
            guide = _guide(req)
            if not req.params.speculate or (guide is not None and guide.error):
                continue  # opted out, or a grammar already broken (the request fails)
            if req.spec is None:
                req.spec = self._new_state()
            room = min(req.params.max_tokens - req.num_output_tokens,
                       self.max_model_len - len(req.token_ids)) - 1
            k = min(req.spec.want(), room, cap)
            if k > 0:
                cands.append(req)
                ks.append(k)
        if not cands:
            return
        if self.proposer.in_step:
            for req, k in zip(cands, ks):
                req.draft = [PENDING] * k
            return
        for req, k, draft in zip(cands, ks, self.proposer.propose(cands, ks)):
            req.draft = fit_grammar(req, draft, k)

    def _new_state(self) -> SpecState:
        st = SpecState(self.start_k, self.k, low=self.low)
        if self.rate < self.low:  # recent guesses, over all requests, mostly rejected
            st.off_steps, st.backoff, st.rate = START_PAUSED, 2 * START_PAUSED, 0.5
        return st

    def fill(self, entries: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Run an in-step proposer over the scheduled rows that reserved slots; returns
        the entries with each row's length matching its guesses."""
        rows = [req for req, _ in entries if req.draft]
        if not self.proposer.in_step or not rows:
            return entries
        for req, draft in zip(rows, self.proposer.propose(rows, [len(r.draft) for r in rows])):
            fitted = fit_grammar(req, draft, len(req.draft))
            same = next((i for i, (a, b) in enumerate(zip(draft, fitted)) if a != b),
                        min(len(draft), len(fitted)))
            if same < len(draft):  # a separate draft's K/V after a changed guess is stale
                req.spec.draft_computed = min(req.spec.draft_computed,
                                              req.num_computed_tokens + 1 + same)
            req.draft = fitted
        ids = {id(r) for r in rows}
        return [(req, 1 + len(req.draft) if id(req) in ids else n) for req, n in entries]

    def record(self, req: Request, emitted: int, kept: int) -> None:
        """A verified row: ``emitted`` tokens came out of it, ``kept`` of them were
        committed (fewer when the request finished inside the run)."""
        proposed = len(req.draft)
        accepted = emitted - 1
        st = self.counters.get(self.proposer.name)
        st.verifications += 1
        st.proposed += proposed
        st.accepted += accepted
        st.emitted += kept
        req.spec.update(proposed, accepted)
        self.rate += RECENT * (accepted / proposed - self.rate)
