"""Token sampling: per-request parameters, the batched sampler, stop strings.

``SamplingParams`` and ``StopStringMatcher`` are torch-free (the router imports
them); the sampler's names load torch on first use only.
"""
from __future__ import annotations

from typing import Any

from engine.sampling.params import MAX_LOGPROBS, SamplingParams
from engine.sampling.stop import StopStringMatcher

_LAZY = ("Sampler", "SamplerOutput", "SamplingState", "TokenLogprobs", "apply_penalties")

__all__ = ["MAX_LOGPROBS", "SamplingParams", "StopStringMatcher", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from engine.sampling import sampler
        return getattr(sampler, name)
    raise AttributeError(f"module 'engine.sampling' has no attribute {name!r}")
