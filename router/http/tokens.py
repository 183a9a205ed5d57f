"""Reading vLLM's /tokenize and /detokenize bodies (router/tokenize_api.py): the
checks every body gets (router/http/intake.py), then the prompt or the messages
rendered as a chat completion renders them."""
from __future__ import annotations

import json

from fastapi import Request

from router.http.errors import APIError
from router.http.intake import Reader
from router.structured import tool_plan
from router.tokenize_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


class TokenReader(Reader):
    async def tokenize(self, request: Request) -> tuple[list[int], bool]:
        """The ids of a /tokenize body's prompt or messages (rendered as a chat request
        renders them), and whether it asks for each token's text."""
        body = await self._validated(request, _tokenize_body)
        if isinstance(body, TokenizeCompletionRequest):
            ids = await self.state.parsing.run(self.state.tokenizer.encode, body.prompt,
                                               body.add_special_tokens)
            return ids, body.return_token_strs
        try:
            plan = tool_plan(body, self.state.tokenizer.chat_template)
        except ValueError as e:
            raise APIError.invalid(e) from None
        return await self.state.parsing.run(self._chat_ids, body, plan), body.return_token_strs

    async def detokenize(self, request: Request) -> list[int]:
        body = await self._validated(request, DetokenizeRequest.model_validate_json)
        vocab = self.state.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary "
                                f"[0, {vocab})", param="tokens")
        return body.tokens


def _tokenize_body(raw: bytes) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """A chat-style body (it has messages) or a completion-style one (a prompt)."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}") from None
    chat = isinstance(data, dict) and "messages" in data
    return (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate(data)
