"""The proposer contract, its registry, and the per-request speculation state.

A proposer guesses up to k tokens that follow a request's context. Every guess is a
point mass (one token, no distribution), so verification (verify.py) accepts a guess d
with exactly the target's probability p(d) and otherwise samples the target restricted
to tokens other than d: the output keeps the target's distribution whatever the
proposer guessed. Torch-free except for the proposers that run a model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.registry import Registry

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.tokenizer import Tokenizer

PROPOSERS: Registry[type["Proposer"]] = Registry(
    "speculative method", "--speculative-method", {
        "ngram": "engine.spec.ngram:NgramProposer",
        "suffix": "engine.spec.suffix:SuffixProposer",
        "draft": "engine.spec.draft:DraftProposer",
    })


class Proposer(ABC):
    name: str
    in_step: bool = False
    """False: ``propose`` runs before scheduling, from the token history alone. True: it
    runs after scheduling, writing into the KV slots the verify pass then overwrites (a
    draft model), so the scheduler first reserves k slots per row."""

    @classmethod
    def create(cls, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer
               ) -> Proposer:
        """Build one for this engine (a draft model loads here; bad input raises
        ValueError naming the flag)."""
        return cls()

    @abstractmethod
    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """At most ks[i] tokens that may follow reqs[i].token_ids (fewer, or none, when
        the proposer has no guess). No side effect on the requests."""


@dataclass
class SpecState:
    """One request's adaptive speculation length (the controller lives here)."""

    k: int
    """Tokens to propose next step."""
    max_k: int
    rate: float = 1.0
    """Moving average of the fraction of proposed tokens accepted."""
    verifies: int = 0
    off_steps: int = 0
    """Steps left with speculation off (low acceptance), then one probe."""
    backoff: int = 4
    proposed: int = 0
    accepted: int = 0
    """Totals for this request (its trace)."""
    draft_computed: int = 0
    """A draft model with its own KV: leading tokens whose draft KV is written."""
    draft_preemptions: int = 0

    def want(self) -> int:
        """Tokens to propose this step (0: speculation off for now)."""
        if self.off_steps > 0:
            self.off_steps -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: grow k while everything is accepted, shrink it to what
        was, and turn speculation off for a while (doubling) when acceptance stays low."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifies += 1
        self.rate = 0.6 * self.rate + 0.4 * (accepted / proposed)
        self.k = min(self.max_k, self.k + 1) if accepted == proposed else max(1, accepted + 1)
        if self.verifies >= 2 and self.rate < LOW_ACCEPTANCE:
            self.off_steps, self.backoff = self.backoff, min(64, self.backoff * 2)
            self.rate = 0.5  # the probe after the pause starts from a neutral estimate
        elif self.rate >= 0.5:
            self.backoff = 4


LOW_ACCEPTANCE = 0.25
"""Below this moving acceptance rate a request stops speculating for a while."""


@dataclass
class SpecStats:
    """Cumulative counters of one proposer (tandem:spec_decode_* metrics)."""

    verifications: int = 0
    """Rows verified (one per speculating request per step)."""
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    """Tokens produced by verified rows (accepted plus the one the target sampled)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified row, the target's own included (1.0 = nothing accepted)."""
        return self.emitted / self.verifications if self.verifications else 0.0


@dataclass
class SpecCounters:
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)

    def get(self, name: str) -> SpecStats:
        return self.by_proposer.setdefault(name, SpecStats())
