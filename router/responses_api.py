"""OpenAI's /v1/responses request (pydantic) and its translation into a chat request.

A Responses request is served as the chat completion it amounts to: ``instructions``
becomes the first system message, ``input`` (a string, or items: messages, the
model's earlier function_call items and their function_call_output items) the
messages after the stored conversation of ``previous_response_id``; function tools,
tool_choice and text.format become tools, tool_choice and response_format. The
fields OpenAI defines that have no meaning here are accepted with no effect, or
refused with a 400 naming them when set (REFUSED).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.errors import FieldError
from router.openai_api import FunctionName, _Strict

NO_EFFECT = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier",
             "prompt_cache_retention", "prompt_cache_options", "reasoning", "include",
             "truncation", "max_tool_calls", "stream_options")
REFUSED = {"background": "background responses are not supported",
           "conversation": "conversations are not supported; use previous_response_id",
           "prompt": "prompt templates are not supported", "top_logprobs": "not supported yet",
           "moderation": "no moderation", "context_management": "not supported",
           "access_programs": "not supported", "background_options": "not supported",
           "image": "text only"}


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    allowed_callers: Any = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None
    """No effect."""


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    priority: int = 0
    """Tandem's (and the x-priority header)."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    stream_options: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    moderation: Any = None
    context_management: Any = None
    access_programs: Any = None
    background_options: Any = None
    image: Any = None

    def refuse_unsupported(self) -> None:
        for name, why in REFUSED.items():
            if getattr(self, name) not in (None, False, 0):
                raise FieldError(name, f"{name}: {why}")

    def chat(self, history: list[dict]) -> tuple[dict, list[dict]]:
        """The chat completion body this request amounts to, and the conversation it
        adds to history (its input as messages: what a later response continues)."""
        added = input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"messages": system + history + added, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls,
                                "priority": self.priority}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type", "allowed_callers"})} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                   {"type": "function",
                                    "function": {"name": self.tool_choice.name}})
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {
                    "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        return body, added


CHAT_FIELD = {"max_tokens": "max_output_tokens", "messages": "input",
              "response_format": "text.format"}
"""A chat field an error names -> the Responses field it came from."""


def input_messages(input_: str | list[dict[str, Any]]) -> list[dict]:
    """Responses input items as chat messages: a message item as it is (its text parts
    joined), the model's function_call items (consecutive ones into one assistant
    turn), function_call_output items as role tool."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    out: list[dict] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function", "function": {
                "name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(item.get("output"), i)})
        else:
            raise FieldError(f"input.{i}", f"input.{i}: items of type {kind!r} are not "
                                           "supported (messages, function_call and "
                                           "function_call_output are)")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise FieldError(f"input.{i}", f"input.{i}: only text content is supported")
