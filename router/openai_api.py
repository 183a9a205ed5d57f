"""OpenAI request models (pydantic) and their mapping to engine SamplingParams.

Unknown fields are rejected (extra="forbid") so a typo is a 400 naming the field,
not a silently ignored option. Tandem extensions: priority, top_k, min_p,
repetition_penalty, ignore_eos, speculate (false opts out of speculative decoding).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, PRIORITY_MAX, PRIORITY_MIN
from engine.sampling import SamplingParams

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    n: Literal[1] = 1
    stop: StopString | list[StopString] | None = Field(default=None,
                                                        max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    """Lower = more important (Tandem extension; also the x-priority header)."""
    ignore_eos: bool = False
    speculate: bool = True
    """False: no speculative decoding for this request (Tandem extension)."""

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
            ignore_eos=self.ignore_eos, logprobs=logprobs, speculate=self.speculate)


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
