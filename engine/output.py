"""Turns sampled tokens into request outputs: detokenization, stop conditions.

Stop checks run in this order after each token: EOS (unless ignore_eos), a stop
token id, a stop string (text held back while it may be a prefix of one),
max_tokens, the context window.
"""
from __future__ import annotations

import time

from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampling import TokenLogprobs
from engine.text import TextAssembler
from engine.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.text: dict[str, TextAssembler] = {}

    def register(self, req: Request) -> None:
        # everything known at admission (prompt, plus outputs made elsewhere) is context
        p = req.params
        self.text[req.request_id] = TextAssembler(self.tokenizer, req.token_ids, p.stop,
                                                  p.include_stop_str_in_output)

    def forget(self, request_id: str) -> None:
        """No text is owed for this request any more (handed off to another worker)."""
        self.text.pop(request_id, None)

    def append(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        return self.append_many(req, [token], [logprobs])

    def append_many(self, req: Request, tokens: list[int],
                    logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Commit tokens one by one, stopping at the first that finishes the request (the
        rest of a speculative run is dropped); one output for all of them."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        out = RequestOutput(req.request_id, [], "", False, None, [], req.num_prompt_tokens,
                            0, req.num_cached_tokens)
        for token, lp in zip(tokens, logprobs):
            delta, reason = self._commit(req, token)
            out.new_token_ids.append(token)
            out.text += delta
            if lp is not None:
                out.logprobs.append(lp)
            if reason is not None:
                out.finished, out.finish_reason = True, reason
                out.text += self._close(req, reason)
                break
        out.num_output_tokens = req.num_output_tokens
        return out

    def _commit(self, req: Request, token: int) -> tuple[str, FinishReason | None]:
        """Append one token; its new text and the reason it finishes the request, if any."""
        req.token_ids.append(token)
        req.sampling.append(token)
        p = req.params
        text = self.text.get(req.request_id)
        delta, hit = text.add([token]) if text is not None else ("", False)
        if token in self.eos and not p.ignore_eos or token in p.stop_token_ids or hit:
            return delta, FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            return delta, FinishReason.LENGTH
        return delta, None

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Finish outside the token path (abort, error)."""
        return RequestOutput(req.request_id, [], self._close(req, reason), True, reason,
                             num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens, error=error)

    def _close(self, req: Request, reason: FinishReason) -> str:
        """Finish req; returns the text still owed (none after an abort or once a stop
        string matched)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        text = self.text.pop(req.request_id, None)
        if text is None:
            return ""
        tail, _ = text.close(aborted=reason is FinishReason.ABORT)
        return tail
