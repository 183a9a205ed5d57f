"""vLLM's /tokenize and /detokenize request bodies (pydantic).

/tokenize takes a completion-style body (``prompt``) or a chat-style one
(``messages``, rendered through the chat template as /v1/chat/completions renders
it, tools included); it answers ``{count, max_model_len, tokens, token_strs}``.
/detokenize takes ``{tokens}`` and answers ``{prompt}``.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from core.limits import MAX_TOOLS
from router.openai_api import ChatMessage, Tool, _Strict


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False
    """Also return each token's text."""


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    @property
    def tool_choice(self) -> None:
        """Tools are shown to the model as a chat request under tool_choice auto shows them."""
        return None

    @property
    def parallel_tool_calls(self) -> bool:
        return True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
