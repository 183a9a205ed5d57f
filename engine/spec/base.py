"""The proposer contract (its registry: registry.py; per-request state: state.py).

A proposer guesses up to k tokens that follow a request's context. Every guess is a
point mass (one token, no distribution), so verification (verify.py) accepts a guess d
with exactly the target's probability p(d) and otherwise samples the target restricted
to tokens other than d: the output keeps the target's distribution whatever the
proposer guessed. Torch-free except for the proposers that run a model.

A guess may draw on other requests' tokens only when they share the request's cache
salt (Request.cache_salt, the tenant's): a guess is accepted faster when it is right,
so guesses taken from another tenant's outputs would let one tenant time what another
was told (the suffix proposer keeps one history per salt; n-gram lookup and the draft
models read the request's own tokens and KV only).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import SpecConfig
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from core.tokenizer import Tokenizer


class Proposer(ABC):
    name: str
    cost: float = 0.0
    """What guessing one token costs, as a fraction of a plain decode step (a draft
    model's forward pass; 0 for a lookup). Raises the acceptance a request needs to
    keep speculating, and starts requests at one guess."""
    in_step: bool = False
    """False: ``propose`` runs before scheduling, from the token history alone. True: it
    runs after scheduling, writing into the KV slots the verify pass then overwrites (a
    draft model), so the scheduler first reserves k slots per row."""

    @classmethod
    def create(cls, config: SpecConfig, runner: ModelRunner, tokenizer: Tokenizer
               ) -> Proposer:
        """Build one for this engine (a draft model loads here; bad input raises
        ValueError naming the flag)."""
        return cls()

    def bind(self, tables: dict[str, list[int]]) -> None:
        """The engine's block tables (KVCacheManager.tables), for in-step proposers."""

    @abstractmethod
    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """At most ks[i] tokens that may follow reqs[i].token_ids (fewer, or none, when
        the proposer has no guess). No side effect on the requests."""
