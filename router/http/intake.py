"""From an HTTP request to what the flow runs (an ``Intake``): the body parsed, the
output constraint checked and compiled, the prompt rendered and tokenized, the sampling
parameters checked. Everything whose cost grows with the request's content runs off the
event loop (offload.py), each within a budget: the body's size (--max-body-bytes), the
prompt's length (below), the constraint's size and its compile and search budgets
(engine/guided). The parsed body is not kept: a request waiting for admission holds
its Intake only. Every error is an APIError naming the field.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import jinja2
from fastapi import Request
from pydantic import BaseModel, ValidationError

from core.errors import FieldError
from core.kv.policy import parse_kv_policy
from core.limits import MAX_BATCH_PROMPTS, check_priority, check_prompt
from core.sampling import SamplingParams
from router.cache_salt import request_salt
from router.http.errors import APIError
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.prompts import bad_words_ids, truncated
from router.request_fields import refuse_unsupported
from router.state import RouterState
from router.structured import Constraint, constraint_of
from router.tools import ToolPlan, template_messages

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Intake:
    """One request, ready to queue."""

    prompt_ids: list[int]
    params: SamplingParams
    chat: bool
    logprobs: int | None
    """Top alternatives per token (0: the chosen token's only); None: no logprobs."""
    stream: bool
    include_usage: bool
    tools: ToolPlan | None
    priority: int
    deadline: float
    """time.monotonic() after which the request is refused or ended (504)."""
    cache_salt: bytes = field(default=b"", repr=False)
    """Which prefix cache the request's KV belongs to (router/cache_salt.py)."""
    return_token_ids: bool = False
    """vLLM's: the response carries prompt_token_ids and each choice's token_ids."""
    tokens_as_ids: bool = False
    """vLLM's return_tokens_as_token_ids: logprobs name tokens token_id:<id>."""
    echo: str | None = None
    """completions' echo: the prompt's text, sent back before the completion."""
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: the response carries them (top N each)."""
    n: int = 1
    """Choices returned (params.n sequences are generated: more with best_of)."""
    lora: str = ""
    """The LoRA adapter its model field names ("": the base model)."""
    continuous_usage: bool = False
    """vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage
    so far."""
    kv_policy: str = ""
    """Its kv_policy as given ("": the workers' --kv-policy)."""


class Reader:
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def completions(self, request: Request) -> list[Intake]:
        """One Intake per prompt of the body (a string or token ids, or a list of either),
        in order; a prompt's error is a 400 naming prompt[i] when there are several."""
        body = await self._parse(request, CompletionRequest)
        _check_choices(body)
        prompts = body.prompts()
        if not prompts or len(prompts) > MAX_BATCH_PROMPTS:
            raise APIError(400, f"prompt: 1 to {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}",
                           param="prompt")
        constraint = await self._constraint(body)
        window, _ = self._length_limit(body)
        intakes = []
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str):
                    ids = await self.state.parsing.run(self._encode, prompt,
                                                       body.add_special_tokens, window)
                else:
                    ids = list(prompt)
                intakes.append(await self._intake(request, body, ids, False, body.logprobs,
                                                  constraint, prompt))
            except APIError as e:
                raise e.of_prompt(i) if len(prompts) > 1 else e
        return intakes

    async def chat(self, request: Request) -> Intake:
        return await self._chat(request, await self._parse(request, ChatCompletionRequest))

    async def _chat(self, request: Request, body: ChatCompletionRequest) -> Intake:
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        _check_choices(body)
        constraint = await self._constraint(body)
        ids = await self.state.parsing.run(self._chat_ids, body, constraint.tools)
        lp = (body.top_logprobs or 0) if body.logprobs else None
        return await self._intake(request, body, ids, True, lp, constraint)

    async def _parse(self, request: Request, model: type[M]) -> M:
        """The body as the model, checked first for what costs nothing to check (the
        served model, the priority and the deadline headers)."""
        body = await self._validated(request, model.model_validate_json)
        request.state.priority = self._priority(request, body)
        request.state.deadline = self._deadline(request)
        return body

    async def _validated(self, request: Request, validate: Callable[[bytes], M]) -> M:
        """The body validated (on the parsing pool), its refused fields refused and its
        model checked; APIError naming the field otherwise."""
        raw = await _body(request)
        try:
            body = await self.state.parsing.run(validate, raw)
        except ValidationError as e:
            raise APIError.from_errors(e.errors()) from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        try:
            refuse_unsupported(body)
        except ValueError as e:
            raise APIError.invalid(e) from None
        if body.model not in (None, "", self.state.model_name) \
                and not self.state.loras.offers(body.model):
            served = [self.state.model_name, *self.state.loras.served()]
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served))}", param="model")
        return body

    async def _intake(self, request: Request, body, ids: list[int], chat: bool,
                      logprobs: int | None, constraint: Constraint,
                      prompt: str | list[int] | None = None) -> Intake:
        """prompt: the completions prompt as the body gave it (echo sends it back)."""
        given = ids
        ids, params = await self.state.parsing.run(self._params, body, ids, logprobs,
                                                   constraint)
        echo = None
        if getattr(body, "echo", False):  # the text given, unless truncation cut it
            echo = prompt if isinstance(prompt, str) and ids is given else \
                await self.state.parsing.run(self.state.tokenizer.decode, ids, False)
        salt = request_salt(getattr(request.state, "api_key", None), body.cache_salt)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return Intake(ids, params, chat, logprobs, body.stream, usage,
                      constraint.tools, request.state.priority, request.state.deadline, salt,
                      body.return_token_ids, body.return_tokens_as_token_ids, echo,
                      body.prompt_logprobs, body.n,
                      body.model if body.model not in (None, self.state.model_name) else "",
                      usage and body.stream_options.continuous_usage_stats, body.kv_policy or "")

    # -- on the pools ------------------------------------------------------------------
    async def _constraint(self, body) -> Constraint:
        """The request's constraint, checked and compiled on the constraint pool; the
        loop does nothing for a request without one."""
        if not _constrains(body):
            return Constraint()
        max_tokens = body.max_tokens or self.state.config.default_max_tokens
        return await self.state.constraints.run(self._checked_constraint, body, max_tokens)

    def _checked_constraint(self, body, max_tokens: int) -> Constraint:
        try:
            constraint = constraint_of(body, self.state.tokenizer.chat_template)
            if constraint.spec is not None:  # the same check every worker makes
                self.state.flow.guided.check(constraint.spec, max_tokens, constraint.field)
        except RecursionError:
            raise APIError(400, "the output constraint is nested too deeply",
                           param=_constraint_field(body)) from None
        except ValueError as e:
            raise APIError.invalid(e) from None
        return constraint

    def _encode(self, prompt: str, add_special_tokens: bool, window: int) -> list[int]:
        """The prompt's tokens; a prompt too long for any tokenization to fit ``window``
        tokens (``_length_limit``) is refused before it is tokenized (its size budget)."""
        tok = self.state.tokenizer
        if len(prompt) > window * tok.longest_token_chars:
            raise APIError(400, f"prompt: {len(prompt)} characters cannot fit the request's "
                                f"{window} tokens", param="prompt")
        return tok.encode(prompt, add_special_tokens=add_special_tokens)

    def _length_limit(self, body) -> tuple[int, str]:
        """(most tokens, prompt and output, the request may have; what that limit is), as
        its worker counts them (engine/llm_engine.py make_request): the context window,
        or --max-stream-len under a bounded kv_policy (its own, else the workers'
        --kv-policy), which generates past the window. Whether a worker takes the policy
        is the worker's to say; a malformed one is a 400 naming kv_policy here."""
        cfg = self.state.config
        try:
            policy = parse_kv_policy(body.kv_policy or cfg.kv_policy,
                                     "kv_policy" if body.kv_policy else "--kv-policy")
        except FieldError as e:
            raise APIError.invalid(e) from None
        if policy is None:
            return cfg.max_model_len, "the context window (max_model_len)"
        return cfg.max_stream_len, "a bounded kv_policy's length (max_stream_len)"

    def _chat_ids(self, body: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items()
                  if k not in ("messages", "add_generation_prompt", "tokenize", "bos_token",
                               "eos_token")}
        try:
            text = self._render(messages, tools, body.add_generation_prompt, kwargs)
        except RecursionError:
            raise APIError(400, "messages are nested too deeply", param="messages") from None
        except (ValueError, jinja2.TemplateError) as e:
            # A template that refuses only once the tools are in (Gemma 2's: no tools, no
            # system turn to list them in) is refusing the tools: name them.
            if tools is not None and self._renders(messages, body.add_generation_prompt, kwargs):
                raise APIError(400, f"tools: this model's chat template cannot take tools "
                                    f"({e})", param="tools") from None
            raise APIError(400, str(e), param="messages") from None
        return self.state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    def _render(self, messages: list[dict], tools: ToolPlan | None, add_generation_prompt: bool,
                kwargs: dict) -> str:
        """The chat template's text; ValueError or jinja2.TemplateError (the template's
        own raise_exception) where the template refuses the conversation."""
        tok = self.state.tokenizer
        messages, extra = template_messages(messages, tools, tok.chat_template)
        return tok.apply_chat_template(messages, add_generation_prompt, **{**kwargs, **extra})

    def _renders(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> bool:
        try:
            self._render(messages, None, add_generation_prompt, kwargs)
        except (ValueError, jinja2.TemplateError, RecursionError):
            return False
        return True

    def _params(self, body, ids: list[int], logprobs: int | None,
                constraint: Constraint) -> tuple[list[int], SamplingParams]:
        """The prompt (truncated as the body asks) and SamplingParams for the request;
        APIError (400) naming the field otherwise."""
        st = self.state
        window, limit = self._length_limit(body)
        try:
            ids = truncated(ids, body.truncate_prompt_tokens, window, body.max_tokens, limit)
            check_prompt(ids, st.tokenizer.vocab_size, window, max_tokens=body.max_tokens,
                         limit=limit)
            params = body.sampling(st.config.default_max_tokens, logprobs, constraint.spec,
                                   bad_words_ids(st.tokenizer, body.bad_words or ()))
            params.check_vocab(st.tokenizer.vocab_size)
            return ids, params
        except ValueError as e:
            raise APIError.invalid(e) from e

    # -- headers -------------------------------------------------------------------------
    def _priority(self, request: Request, body) -> int:
        """The request's priority (x-priority wins over the body's), within its API key's
        ceiling: a key whose ceiling is 5 cannot claim priority 0 (403)."""
        header = request.headers.get("x-priority")
        priority = body.priority
        if header is not None:
            try:
                priority = check_priority(int(header), "x-priority")
            except ValueError as e:
                raise APIError(400, f"x-priority header must be an integer in the int32 range, "
                                    f"got {header!r}", param="x-priority") from e
        key = getattr(request.state, "api_key", None)
        if key is not None and key.priority_ceiling is not None and priority < key.priority_ceiling:
            raise APIError(403, f"priority {priority} is more important than API key "
                                f"{key.name!r} may claim (its ceiling is {key.priority_ceiling}; "
                                "lower values are more important)", "permission_error",
                           param="x-priority" if header is not None else "priority")
        return priority

    def _deadline(self, request: Request) -> float:
        header = request.headers.get("x-request-timeout")
        timeout = self.state.config.request_timeout_s
        if header is not None:
            try:
                value = float(header)
                if not value > 0:
                    raise ValueError
            except ValueError:
                raise APIError(400, f"x-request-timeout must be seconds > 0, got {header!r}",
                               param="x-request-timeout") from None
            timeout = min(timeout, value)
        return time.monotonic() + timeout


def _check_choices(body) -> None:
    """n and best_of together, as OpenAI and vLLM take them (each alone is checked by
    the model: 1 to MAX_CHOICES)."""
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of < body.n:
        raise APIError(400, f"best_of: must be at least n ({body.n}), got {best_of}",
                       param="best_of")
    if best_of is not None and best_of > body.n and body.stream:
        raise APIError(400, "best_of: cannot be used with stream (the best sequences are "
                            "known only once all have finished)", param="best_of")
    if body.n > 1 and body.stream and getattr(body, "tools", None):
        raise APIError(400, "n: more than one choice with streamed tool calls is not "
                            "supported", param="n")


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structured_outputs", "tools", "tool_choice")


def _constrains(body) -> bool:
    return any(getattr(body, f, None) is not None for f in _CONSTRAINT_FIELDS)


def _constraint_field(body) -> str | None:
    return next((f for f in _CONSTRAINT_FIELDS if getattr(body, f, None) is not None), None)


async def _body(request: Request) -> bytes:
    """The body the edge guard replays (read from receive, so no copy is cached on the
    Request for the request's life)."""
    parts = []
    while True:
        msg = await request.receive()
        if msg["type"] != "http.request":
            raise APIError(400, "the client went away before its body arrived")
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)
