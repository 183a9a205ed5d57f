"""Token sampling on the model's logits: the batched sampler and its logit processors.
The per-request parameters and stop strings are core's (core/sampling)."""
from __future__ import annotations

from engine.sampling.sampler import (Sampler, SamplerOutput, SamplingState, TokenLogprobs,
                                     apply_penalties, token_logprobs)

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "TokenLogprobs", "apply_penalties",
           "token_logprobs"]
