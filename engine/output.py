"""Turns sampled tokens into request outputs: detokenization, stop conditions.

Stop checks run in this order after each token: a token the request's grammar
refuses (error), EOS (unless ignore_eos), a stop token id, a stop string (text held
back while it may be a prefix of one), a grammar that is complete, max_tokens, the
context window. A constrained request therefore ends "stop" only with a complete
output (its grammar allows EOS only there, and a stop string inside the structure
is just text), and "length" when max_tokens cuts it short.
"""
from __future__ import annotations

import time

from core.guided.compiler import GrammarCompiler
from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampling import TokenLogprobs
from core.text import TextAssembler
from core.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int,
                 guided: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.guided = guided
        self.text: dict[str, TextAssembler] = {}

    def register(self, req: Request) -> None:
        # everything known at admission (prompt, plus outputs made elsewhere) is context;
        # the stop-string check starts from the grammar state after those outputs
        p = req.params
        accept = None
        if self.guided is not None and p.guided is not None and p.stop:
            accept = self.guided.acceptor(p.guided, p.stop, req.sampling.guide)
        self.text[req.request_id] = TextAssembler.for_params(self.tokenizer, req.token_ids, p,
                                                             accept, req.num_output_tokens)

    def forget(self, request_id: str) -> None:
        """No text is owed for this request any more (handed off to another worker)."""
        self.text.pop(request_id, None)

    def append(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        return self.append_many(req, [token], [logprobs])

    def append_many(self, req: Request, tokens: list[int],
                    logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Commit tokens one by one, stopping at the first that finishes the request (the
        rest of a speculative run is dropped); one output for all of them."""
        out = RequestOutput(req.stream_id, [], "", False, None, [], _prompt_logprobs(req),
                            req.num_prompt_tokens, 0, req.num_cached_tokens, index=req.index,
                            num_host_cached_tokens=req.num_host_cached_tokens,
                            num_disk_cached_tokens=req.num_disk_cached_tokens)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for token, lp in zip(tokens, logprobs):
            delta, reason = self._commit(req, token)
            out.new_token_ids.append(token)
            out.text += delta
            if lp is not None:
                out.logprobs.append(lp)
            if reason is not None:
                out.finished, out.finish_reason = True, reason
                if reason is FinishReason.ERROR:
                    out.error = f"constrained decoding failed: {req.sampling.guide.error}"
                out.text += self._close(req, reason)
                break
        out.num_output_tokens = req.num_output_tokens
        return out

    def _commit(self, req: Request, token: int) -> tuple[str, FinishReason | None]:
        """Append one token; its new text and the reason it finishes the request, if any."""
        req.token_ids.append(token)
        req.sampling.append(token)
        text = self.text.get(req.request_id)
        delta, hit = text.add([token]) if text is not None else ("", False)
        return delta, self._reason(req, token, hit)

    def _reason(self, req: Request, token: int, hit: bool) -> FinishReason | None:
        p, guide = req.params, req.sampling.guide
        if guide is not None and guide.error:
            return FinishReason.ERROR
        # a grammar allows EOS only where the output is complete; a stop token id ends a
        # constrained output only there too (elsewhere it is part of the structure)
        eos = token in self.eos and (not p.ignore_eos or guide is not None)
        stop_id = token in p.stop_token_ids and (guide is None or guide.matcher.is_accepting())
        if eos or stop_id or hit or (guide is not None and guide.stopped):
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens \
                or len(req.token_ids) >= (req.max_total_len or self.max_model_len):
            return FinishReason.LENGTH
        return None

    def prompt_done(self, req: Request) -> RequestOutput:
        """A max_tokens 0 request whose prompt is computed: it ends (length) with no token;
        its prompt logprobs, when asked, are its whole output."""
        out = self.finish(req, FinishReason.LENGTH)
        out.prompt_logprobs = _prompt_logprobs(req)
        return out

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Finish outside the token path (abort, error)."""
        return RequestOutput(req.stream_id, [], self._close(req, reason), True, reason,
                             num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens, error=error,
                             index=req.index,
                             num_host_cached_tokens=req.num_host_cached_tokens,
                             num_disk_cached_tokens=req.num_disk_cached_tokens)

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


def _prompt_logprobs(req: Request) -> list[TokenLogprobs] | None:
    """What a request's first output carries of its prompt logprobs: all of them, when
    it asked (its prompt is computed by then), else None."""
    if req.params.prompt_logprobs is None or req.first_token_time is not None:
        return None
    return list(req.prompt_logprobs)
