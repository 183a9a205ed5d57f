"""Whether a constrained output is complete where a stop string occurs (a stop
string inside the structure, in a JSON string say, is just text): the stop-string
matcher's ``Acceptor`` (core/sampling/stop.py) over a grammar.

One matcher is advanced over the output once, as it is confirmed; a candidate
occurrence consumes only the text after it and is rolled back, so a step costs
O(its new text), not the whole output per occurrence. Text is tokenized a piece at a
time: the matcher takes any tokenization of the same bytes (llguidance masks by
bytes), so the pieces' boundaries do not change the answer. Torch-free.
"""
from __future__ import annotations

from collections.abc import Callable

import llguidance


class GrammarAcceptor:
    """Used by one request's text on one thread (the engine's, or the router's loop)."""

    def __init__(self, matcher: llguidance.LLMatcher,
                 tokenize: Callable[[bytes], list[int]]) -> None:
        """matcher: the request's grammar at the start of the text to come (owned
        here: it is advanced). tokenize: bytes -> the matcher's token ids."""
        self._matcher = matcher
        self._tokenize = tokenize

    def confirm(self, text: str) -> None:
        # a refused piece leaves the matcher in error: then nothing after it completes
        if text:
            self._matcher.consume_tokens(self._tokenize(text.encode("utf-8")))

    def accepts(self, text: str) -> bool:
        ids = self._tokenize(text.encode("utf-8")) if text else []
        taken = self._matcher.try_consume_tokens(ids) if ids else 0
        complete = taken == len(ids) and self._matcher.is_accepting()
        if taken:
            self._matcher.rollback(taken)
        return complete
