"""A request's life inside one engine: tokens, progress, sampling and output state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from core.kv.block_hash import BlockHash
from core.kv.policy import KVPolicy
from core.sampling import SamplingParams
from engine.lora.adapter import LoRAAdapter
from engine.sampling import SamplingState, TokenLogprobs
from engine.spec.state import SpecState, SpecSummary


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, its leading KV written from elsewhere
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV waits in the host swap pool
    FINISHED = "finished"


class DuplicateRequestError(ValueError):
    """A request id that is already live in this engine (queued, running, or its blocks
    kept by a KV connector). Ids are keys: a second request under one is refused."""


class AbortedBeforeArrival(RuntimeError):
    """An Abort for this request id reached the engine before the request did (the
    caller gave up while its call was on the wire, engine/aborts.py): it is not run."""


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
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    """Of num_cached_tokens, those promoted for this request from the host and the disk
    tier (docs/kv-offload.md)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    cache_salt: bytes = field(default=b"", repr=False)
    """Seeds block_hashes (core/kv/block_hash.py): the tenant's digest the router
    sends; empty = the shared, unsalted cache. Kept out of repr: it names a tenant's
    cache, and a repr may reach a log."""
    lora: LoRAAdapter | None = field(default=None, repr=False)
    """The LoRA adapter it runs under (engine/lora/), None: the base model. Its identity
    is folded into cache_salt (LLMEngine.make_request)."""
    kv_policy: KVPolicy | None = None
    """A bounded KV policy (engine/kv_cache/policy.py); None: full, every token kept."""
    kv_scores: object | None = field(default=None, repr=False)
    """Under h2o: the accumulated attention per cache slot, a tensor [L, Hkv, budget]
    the runner keeps (engine/kv_cache/h2o.py); None otherwise."""
    kv_arrivals: object | None = field(default=None, repr=False)
    """Under h2o with score=mean: each cache slot's token's index in the input, an int32
    tensor [L, Hkv, budget] moved with kv_scores (engine/kv_cache/h2o.py); None otherwise."""
    max_total_len: int | None = None
    """Most tokens (prompt + output) it may reach; None: the engine's context window
    (a bounded request's is --max-stream-len)."""
    finish_reason: FinishReason | None = None
    sampling: SamplingState | None = None
    num_preemptions: int = 0
    preempted_at: float | None = None
    preempted_seconds: float = 0.0
    """Time spent preempted (swapped out or waiting to be recomputed)."""
    first_token_time: float | None = None
    kv_transfer: object | None = None
    """A KV connector's parameters for this request (engine/kv_connector.py), set by
    whoever plugs the connector in before the request is admitted; opaque to the
    engine, read by the connector's scheduler side. None: nothing to transfer."""
    admitted: bool = False
    """Queued by LLMEngine.admit (its id was free)."""
    draft: list[int] = field(default_factory=list)
    """Tokens proposed for this step (speculative decoding); the verify pass scores them
    after the last token and commits only the accepted ones. Empty outside a step."""
    spec: SpecState | None = None
    """Adaptive speculation state (engine/spec/base.py), when the engine speculates."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """When params.prompt_logprobs is set: the logprobs of prompt tokens 1, 2, ...
    computed so far (entry p comes from position p's logits), in prompt order."""
    abort_pending: bool = False
    """An abort arrived while its leading KV is written into its blocks
    (WAITING_FOR_KV): it finishes (and its blocks are freed) when the write ends
    (LLMEngine.finish_loading), not before."""
    index: int = 0
    """Which of its request's n choices this sequence is (engine/fork.py)."""
    group: str | None = None
    """A forked choice's request id, under which its outputs go out; None: its own."""
    forks: list[Request] = field(default_factory=list, repr=False)
    """Choices forked in this step, sampled from this request's logits row (the runner
    draws each from its own stream). Empty outside a step."""
    forked: bool = False
    """Its n - 1 other choices were forked (or it is one of them)."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling is None:
            self.sampling = SamplingState(self.params, self.prompt_token_ids)

    @property
    def stream_id(self) -> str:
        """The id its outputs go out under: its request's, for every choice."""
        return self.group or self.request_id

    @property
    def wants_fork(self) -> bool:
        """n > 1 and its other choices are not forked yet."""
        return self.params.n > 1 and not self.forked

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
    def prompt_logprobs_owed(self) -> int | None:
        """The first prompt position whose logprobs are still owed, None when none are:
        its hidden state must be computed here, so the prefix cache may serve only the
        tokens before it (a cached block keeps K/V, not the logits they came with)."""
        if self.params.prompt_logprobs is None:
            return None
        done = len(self.prompt_logprobs)
        return done if done < self.num_prompt_tokens - 1 else None

    @property
    def may_generate(self) -> bool:
        """False once max_tokens are out: a max_tokens 0 request never samples, and ends
        when its prompt is computed (LLMEngine)."""
        return self.num_output_tokens < self.params.max_tokens

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
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On a request's first output, when it asked (SamplingParams.prompt_logprobs): one
    per prompt token after the first."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    """Of num_cached_tokens, those promoted from the host and the disk tier."""
    spec: SpecSummary | None = None
    """On the last output of a request that speculated: its proposed and accepted totals."""
    kept_blocks: list[int] | None = None
    """The block table a KV connector kept when this request ended after its prompt
    (finish_reason None, KVConnector.request_finished); the connector frees it."""
    num_preemptions: int = 0
    """On the last output: times the request was preempted (swapped out or recomputed)."""
    preempted_seconds: float = 0.0
    """On the last output: time it spent preempted."""
    index: int = 0
    """Which of the request's n choices these tokens belong to (request_id is the
    request's for every choice)."""
