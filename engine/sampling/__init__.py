"""Token sampling: per-request parameters, the batched sampler, stop strings."""
from __future__ import annotations

from engine.sampling.params import MAX_LOGPROBS, SamplingParams
from engine.sampling.sampler import (Sampler, SamplerOutput, SamplingState, TokenLogprobs,
                                     apply_penalties)
from engine.sampling.stop import StopStringMatcher

__all__ = [
    "MAX_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "StopStringMatcher",
    "TokenLogprobs",
    "apply_penalties",
]
