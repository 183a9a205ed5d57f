"""OpenAI response shapes: a whole completion, SSE chunks, usage, logprobs."""
from __future__ import annotations

import json
from dataclasses import dataclass

from core.tokenizer import Tokenizer
from router.flow import Delta, Logprob
from router.trace import Trace
from router.http.echo import PromptPart
from router.tools import ToolPlan


class LogprobFormat:
    """OpenAI logprobs objects: chat (content list, top_logprobs entries) or
    completions (tokens, token_logprobs, top_logprobs dicts, text_offset)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_ids: bool = False) -> None:
        """as_ids: name each token token_id:<id> (vLLM's return_tokens_as_token_ids)."""
        self.tokenizer, self.chat, self.as_ids = tokenizer, chat, as_ids

    def _tok(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render(self, ids: list[int], lps: list[Logprob | None]) -> dict:
        """None: a token with no logprob (an echoed prompt's first; completions only)."""
        pairs = list(zip(ids, lps))
        tokens = [self._tok(t) for t, _ in pairs]
        if self.chat:
            return {"content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                 "top_logprobs": [{"token": (alt := self._tok(t)), "logprob": alp,
                                   "bytes": list(alt.encode())} for t, alp in top]}
                for tok, (_, (lp, top)) in zip(tokens, pairs)]}
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens,
                "token_logprobs": [lp[0] if lp is not None else None for _, lp in pairs],
                "top_logprobs": [{self._tok(t): alp for t, alp in lp[1]}
                                 if lp is not None and lp[1] else None for _, lp in pairs],
                "text_offset": offsets}


def usage(*traces: Trace) -> dict:
    """The usage object of one request, or the sum over a batch's sub-requests."""
    prompt = sum(t.prompt_tokens for t in traces)
    output = sum(t.output_tokens for t in traces)
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "total_tokens": prompt + output, "prompt_tokens_details": cached_details(*traces)}


def cached_details(*traces: Trace) -> dict:
    """OpenAI's cached_tokens, and Tandem's extension cached_tokens_by_tier: where the
    worker found those tokens (device, host memory, disk; docs/kv-offload.md)."""
    host = sum(t.realized_host_cached_tokens for t in traces)
    disk = sum(t.realized_disk_cached_tokens for t in traces)
    cached = sum(t.realized_cached_tokens for t in traces)
    return {"cached_tokens": cached,
            "cached_tokens_by_tier": {"device": cached - host - disk, "host": host, "disk": disk}}


@dataclass(frozen=True)
class ResponseShape:
    """What every response object of one request shares."""

    id: str
    created: int
    model: str
    chat: bool
    logprobs: LogprobFormat | None = None
    include_usage: bool = False
    tools: ToolPlan | None = None
    """Set when the output may hold tool calls (message.tool_calls, finish_reason
    "tool_calls")."""
    prompt_ids: list[int] | None = None
    """vLLM's return_token_ids: the prompt's ids (and each choice's token_ids) go out
    with the response; None: they do not."""
    index: int = 0
    """The choice's index (a batch of prompts: the prompt's)."""
    prompt: PromptPart | None = None
    """What of the prompt goes back (echo, prompt_logprobs); None: nothing."""
    live_usage: Trace | None = None
    """vLLM's continuous_usage_stats: the request's trace, whose usage so far every
    chunk carries (the flow counts each delta's tokens before the chunk is made)."""

    def _logprobs(self, ids: list[int], lps: list[Logprob], d_prompt: list[Logprob] | None,
                  opening: bool) -> dict | None:
        if self.logprobs is None:
            return None
        if self.prompt is not None:
            ids, lps = self.prompt.logprobs(ids, lps, d_prompt, opening)
        return self.logprobs.render(ids, lps)

    def _prompt_fields(self, choice: dict, top: dict, d_prompt: list[Logprob] | None,
                       opening: bool) -> None:
        """vLLM's prompt_logprobs: in the choice (completions) or the response (chat)."""
        if self.prompt is not None and self.prompt.top is not None and opening:
            (top if self.chat else choice)["prompt_logprobs"] = self.prompt.vllm(d_prompt)

    def full(self, text: str, reason: str | None, ids: list[int], lps: list[Logprob],
             trace: Trace, prompt_lps: list[Logprob] | None = None) -> dict:
        """prompt_lps: the first delta's prompt_logprobs."""
        lp = self._logprobs(ids, lps, prompt_lps, True)
        text = self.prompt.text(text, True) if self.prompt is not None else text
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            calls = self.tools.parse(text) if self.tools is not None and reason == "stop" else None
            if calls:
                message, reason = {"role": "assistant", "content": None,
                                   "tool_calls": calls}, "tool_calls"
            choice = {"index": self.index, "message": message, "logprobs": lp,
                      "finish_reason": reason}
        else:
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": reason}
        top = {}
        if self.prompt_ids is not None:
            choice["token_ids"] = ids
            (top if self.chat else choice)["prompt_token_ids"] = self.prompt_ids
        self._prompt_fields(choice, top, prompt_lps, True)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(trace), **top}

    def _event(self, **fields) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.live_usage is not None and "usage" not in fields:
            fields["usage"] = usage(self.live_usage)
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                **fields}
        return f"data: {json.dumps(body)}\n\n"

    def chunk(self, text: str | None, reason: str | None, role: bool = False,
              d: Delta | None = None, first: bool = False) -> str:
        """first: the stream's first chunk (it carries prompt_token_ids when asked)."""
        lps = self._logprobs(d.token_ids, d.logprobs, d.prompt_logprobs, first) \
            if d is not None else None
        if self.prompt is not None and text is not None:
            text = self.prompt.text(text, first)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": self.index, "delta": delta, "logprobs": lps,
                      "finish_reason": reason}
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": lps,
                      "finish_reason": reason}
        top = {}
        if self.prompt_ids is not None:
            choice["token_ids"] = list(d.token_ids) if d is not None else []
            if first:
                (top if self.chat else choice)["prompt_token_ids"] = self.prompt_ids
        self._prompt_fields(choice, top, d.prompt_logprobs if d is not None else None, first)
        return self._event(choices=[choice], **top)

    def tool_call_chunks(self, calls: list[dict]) -> list[str]:
        """Each call as OpenAI streams one: its id, type and name, then its arguments."""
        out = []
        for i, call in enumerate(calls):
            fn = call["function"]
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}}
            for part in (head, {"index": i, "function": {"arguments": fn["arguments"]}}):
                out.append(self._event(choices=[{"index": 0, "delta": {"tool_calls": [part]},
                                                 "logprobs": None, "finish_reason": None}]))
        return out

    def usage_chunk(self, *traces: Trace) -> str:
        return self._event(choices=[], usage=usage(*traces))

    @staticmethod
    def error_event(message: str) -> str:
        err = {"error": {"message": message, "type": "server_error", "param": None,
                         "code": None}}
        return f"data: {json.dumps(err)}\n\n"
