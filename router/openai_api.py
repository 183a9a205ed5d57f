"""OpenAI request models (pydantic) and their mapping to engine SamplingParams.

Every field of OpenAI's Chat Completions and Completions bodies and vLLM's extra
sampling fields is declared: implemented, accepted with no effect, or refused with a
400 naming it (router/request_fields.py says which; README's request-field table
lists them). Any other field is rejected (extra="forbid") so a typo is a 400 naming
the field, not a silently ignored option. A null stands for the field's default, as
OpenAI's schema allows. Tandem extensions: priority, speculate (false opts out of
speculative decoding).
Structured outputs: OpenAI's response_format and tools/tool_choice/parallel_tool_calls,
and vLLM's guided_json, guided_regex, guided_choice, guided_grammar and
structured_outputs (router/structured.py turns them into one constraint).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.guided.spec import GuidedSpec
from core.limits import (MAX_BAD_WORDS, MAX_CACHE_SALT_CHARS, MAX_CHOICES, MAX_STOP_STRING_CHARS,
                         MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS, MAX_TOP_K, PRIORITY_MAX,
                         PRIORITY_MIN)
from core.sampling import SamplingParams

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A null for a field whose default is not null means the default (OpenAI's
        schema makes most fields nullable; clients send nulls)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        keep = {}
        for k, v in data.items():
            f = fields.get(k) or next((f for f in fields.values() if f.alias == k), None)
            if v is None and f is not None and f.default is not None and not f.is_required():
                continue
            keep[k] = v
        return keep


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = False
    """No effect: nothing is padded (the stream is not obfuscated)."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far (benchmark
    clients such as guidellm send it by default)."""


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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices to return: one prefill, the sequences fork its blocks (engine/fork.py)."""
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
    kv_policy: str | None = Field(default=None, max_length=64)
    """The request's KV policy (core/kv/policy.py; Tandem extension): checked here,
    sent to both workers, which take it under --allow-request-kv-policy."""
    # OpenAI, implemented
    logit_bias: dict[int, float] | None = None
    """Token id (a JSON string key) -> bias in [-100, 100], added to the logits."""
    # vLLM's sampling extras, implemented (core/sampling/params.py says what each does)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only the prompt's last N tokens (-1: as many as the context window holds)."""
    return_token_ids: bool = False
    """Add prompt_token_ids and each choice's token_ids to the response."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name each token "token_id:<id>" instead of its text."""
    # accepted with no effect, or refused unless left at the default (request_fields.py)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    request_id: str | None = None
    spaces_between_special_tokens: bool = True
    length_penalty: float = 1.0
    use_beam_search: bool = False
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    """vLLM's: each prompt token's logprob (the first's is null) and the top N, in
    the choice's prompt_logprobs."""
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None

    @property
    def sequences(self) -> int:
        """Sequences to generate: best_of (completions) when set, else n."""
        return getattr(self, "best_of", None) or self.n

    def sampling(self, default_max_tokens: int, logprobs: int | None,
                 guided: GuidedSpec | None = None,
                 bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """bad_words: the body's bad_words as token sequences (the caller tokenizes)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, guided=guided, n=self.sequences,
            # best_of ranks its sequences by cumulative logprob: the engine computes them
            logprobs=0 if logprobs is None and self.sequences > self.n else logprobs,
            speculate=self.speculate, min_tokens=self.min_tokens,
            logit_bias=self.logit_bias or {},
            allowed_token_ids=self.allowed_token_ids, bad_words_token_ids=bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_top())

    def prompt_top(self) -> int | None:
        """How many alternatives the workers compute at each prompt position; None: no
        prompt logprobs."""
        return self.prompt_logprobs


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt (a string or token ids) or a batch of them: a choice per prompt."""
    max_tokens: int | None = Field(default=None, ge=0)
    """0: nothing is generated (with echo: the prompt and its logprobs, as evaluation
    harnesses score them)."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    """The prompt comes back before the completion: in the text, and with logprobs in
    tokens, token_logprobs (null for the first), top_logprobs and text_offset."""
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    """Generate this many sequences and return the n with the highest cumulative logprob
    (>= n; not with stream)."""
    suffix: str | None = None
    add_special_tokens: bool = True
    """vLLM: the tokenizer's special tokens (BOS) around a text prompt."""
    prompt_embeds: Any = None

    def prompt_top(self) -> int | None:
        tops = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None)
                if n is not None]
        return max(tops) if tops else None

    def prompts(self) -> list[str | list[int]]:
        """The body's prompts, in order (a bare string or id list is one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


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
    # vLLM's chat template extras, implemented
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. enable_thinking)."""
    # accepted with no effect, or refused unless left at the default (request_fields.py)
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    include_reasoning: bool = True
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    echo: Literal[False] = False
    """vLLM's chat echo (the last message before the reply) is not supported."""
    continue_final_message: bool = False
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
