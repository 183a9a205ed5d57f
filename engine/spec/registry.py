"""The names behind --speculative-method (torch-free; EngineConfig validates against it)."""
from __future__ import annotations

from core.registry import Registry

PROPOSERS: Registry[type] = Registry(  # entries: engine.spec.base.Proposer subclasses
    "speculative method", "--speculative-method", {
        "ngram": "engine.spec.ngram:NgramProposer",
        "suffix": "engine.spec.suffix:SuffixProposer",
        "draft": "engine.spec.draft:DraftProposer",
    })
