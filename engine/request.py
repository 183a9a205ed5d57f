"""A request's life inside one engine: tokens, progress, sampling and output state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.kv_cache.block_hash import BlockHash
from engine.sampling import SamplingParams, SamplingState, StopStringMatcher, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved, bytes being pulled from a peer
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV waits in the host swap pool
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the context window
    ABORT = "abort"        # the client went away or asked to cancel
    ERROR = "error"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower value = more important (vLLM's convention)."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every token generated so far (what the KV cache holds)."""
    num_computed_tokens: int = 0
    """Leading token_ids whose K/V are in this engine's cache."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at admission (metrics)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    sampling: SamplingState | None = None
    stop_matcher: StopStringMatcher | None = None
    num_preemptions: int = 0
    preempted_at: float | None = None
    preempted_seconds: float = 0.0
    """Time spent preempted (swapped out or waiting to be recomputed)."""
    first_token_time: float | None = None
    prefill_only: bool = False
    """Disaggregated prefill: stop after the first token and keep the KV blocks
    (handed to the caller through LLMEngine.held) instead of freeing them."""
    num_kv_tokens: int = 0
    """Remote admission: leading tokens whose KV arrives from a prefill worker."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling is None:
            self.sampling = SamplingState(self.params, self.prompt_token_ids)
        if self.stop_matcher is None and self.params.stop:
            self.stop_matcher = StopStringMatcher(self.params.stop,
                                                  self.params.include_stop_str_in_output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: priority first, then arrival (FCFS within a priority)."""
        return (self.priority, self.arrival_time)


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta, not the whole output)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    """Newly finalised text (stop-string hold-back applied)."""
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
