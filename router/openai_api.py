"""OpenAI request models (pydantic) and their mapping to engine SamplingParams.

Unknown fields are rejected (extra="forbid") so a typo is a 400 naming the field,
not a silently ignored option. Tandem extensions: priority, top_k, min_p,
repetition_penalty, ignore_eos, speculate (false opts out of speculative decoding);
vLLM's cache_salt.
Structured outputs: OpenAI's response_format and tools/tool_choice/parallel_tool_calls,
and vLLM's guided_json, guided_regex, guided_choice, guided_grammar and
structured_outputs (router/structured.py turns them into one constraint).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.guided.spec import GuidedSpec
from core.limits import (MAX_CACHE_SALT_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TOOLS,
                         MAX_TOP_K, PRIORITY_MAX, PRIORITY_MIN)
from core.sampling import SamplingParams

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs object (the fields Tandem takes; one of them)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
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
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    speculate: bool = True
    """False: no speculative decoding for this request (Tandem extension)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's: only requests with the same salt (and API key's cache) share prefix-cache
    blocks (router/cache_salt.py)."""

    def sampling(self, default_max_tokens: int, logprobs: int | None,
                 guided: GuidedSpec | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
            ignore_eos=self.ignore_eos, logprobs=logprobs, guided=guided,
            speculate=self.speculate)


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema for the arguments object; absent: no arguments."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls, as this API returned them (fed back through the
    chat template)."""
    tool_call_id: str | None = None
    """A role "tool" message: the call it answers."""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
