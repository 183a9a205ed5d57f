"""Per-request speculation state (the adaptive controller) and the proposers' counters.
Torch-free and import-free: engine/request.py holds a SpecState."""
from __future__ import annotations

from dataclasses import dataclass, field

LOW_ACCEPTANCE = 0.25
"""Below this moving acceptance rate a request stops speculating for a while (a free
proposer's break-even; a draft model's adds its cost, Speculator.low)."""


@dataclass
class SpecState:
    """One request's adaptive speculation length (the controller lives here)."""

    k: int
    """Tokens to propose next step."""
    max_k: int
    low: float = LOW_ACCEPTANCE
    """Break-even acceptance: below it (moving average) guessing costs more than it
    saves, and the request pauses (Speculator sets it from the proposer's cost)."""
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

    def summary(self) -> SpecSummary:
        return SpecSummary(self.proposed, self.accepted, self.verifies)

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
        if self.verifies >= 2 and self.rate < self.low:
            self.off_steps, self.backoff = self.backoff, min(64, self.backoff * 2)
            self.rate = 0.5  # the probe after the pause starts from a neutral estimate
        elif self.rate >= 0.5:
            self.backoff = 4


@dataclass(frozen=True)
class SpecSummary:
    """One request's speculation, as its trace reports it when it finishes."""

    proposed: int
    accepted: int
    verifications: int
    """Steps that verified guesses of this request."""


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
