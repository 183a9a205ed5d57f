"""The text a client sees for one request: incremental detokenization (holding back
a split character), then stop strings (holding back what may still become one).

One class serves both places that produce a request's text: the engine's output
processor and the router, which owns the client's text on the disaggregated path.
Torch-free.
"""
from __future__ import annotations

from typing import Sequence

from core.sampling.params import SamplingParams
from core.sampling.stop import Acceptor, StopStringMatcher
from core.tokenizer import IncrementalDetokenizer, Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int],
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 accept: Acceptor | None = None, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        """context_ids: what precedes the output (the prompt, plus outputs made
        elsewhere), so the first output token decodes in context. accept: for a
        constrained request, whether the output before a stop string is complete
        (a stop string inside the structure is just text; StopStringMatcher).
        min_tokens: the text of the first min_tokens tokens is never searched for a
        stop string (vLLM's min_tokens)."""
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)
        self._stop = (StopStringMatcher(stop, include_stop_str_in_output, accept)
                      if stop else None)
        self._unsearched = min_tokens
        """Tokens still to come whose text no stop string may end in."""

    @classmethod
    def for_params(cls, tokenizer: Tokenizer, context_ids: Sequence[int],
                   params: SamplingParams, accept: Acceptor | None = None,
                   made: int = 0) -> TextAssembler:
        """The text of a request sampled under params (the router's and the engine's);
        made: output tokens already in context_ids (a request resumed elsewhere)."""
        return cls(tokenizer, context_ids, params.stop, params.include_stop_str_in_output,
                   accept, params.skip_special_tokens, max(0, params.min_tokens - made))

    @property
    def stopped(self) -> bool:
        """A stop string has matched: no more text comes."""
        return self._stop is not None and self._stop.stopped

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """(text safe to emit now, a stop string matched)."""
        free = min(len(token_ids), self._unsearched)
        self._unsearched -= free
        head = "".join(self._detok.add(t) for t in token_ids[:free])
        text = "".join(self._detok.add(t) for t in token_ids[free:])
        if self._stop is None:
            return head + text, False
        self._stop.skip(head)
        text, hit = self._stop.feed(text) if text else ("", False)
        return head + text, hit

    def close(self, aborted: bool = False) -> tuple[str, bool]:
        """The end of the stream: (the text still owed, a stop string matched in it).
        Nothing after an abort or once a stop string matched."""
        if aborted or self.stopped:
            return "", False
        tail = self._detok.flush()
        if self._stop is None:
            return tail, False
        text, hit = self._stop.feed(tail)
        return (text, True) if hit else (text + self._stop.flush(), False)
