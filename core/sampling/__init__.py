"""Per-request sampling parameters and stop strings (torch-free). The batched sampler
that applies them is the engine's (engine/sampling)."""
from __future__ import annotations

from core.sampling.params import MAX_LOGPROBS, SamplingParams, choice_seed
from core.sampling.stop import StopStringMatcher

__all__ = ["MAX_LOGPROBS", "SamplingParams", "StopStringMatcher", "choice_seed"]
