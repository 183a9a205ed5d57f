"""Suffix decoding (after Arctic's SuffixDecoding, without its suffix tree): find the
longest suffix of the context that occurred before, in the request's own prompt and
output or in the recent outputs of other requests, and propose what followed it.

The longer the match, the likelier the continuation repeats; n-gram lookup (ngram.py)
stops at 4 tokens and sees only its own request. Each search is bytes.rfind over the
tokens packed as 4-byte words, extended one token at a time while it still matches
(at most MAX_MATCH).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.request import Request
from engine.spec.base import Proposer
from engine.spec.ngram import pack, rfind_token_run

MAX_MATCH = 32
HISTORY = 64
"""Other requests' outputs kept for matching (the most recently seen)."""


def longest_match(pattern_src: Sequence[int], hay_tokens: Sequence[int], hay: bytes,
                  end: int, k: int) -> tuple[int, list[int]]:
    """(length, continuation) of the longest suffix of pattern_src found in hay before
    token ``end``, preferring occurrences followed by k tokens."""
    best: tuple[int, list[int]] = (0, [])
    src = pack(pattern_src[-MAX_MATCH:])
    for n in range(1, min(MAX_MATCH, len(pattern_src), end) + 1):
        pattern = src[len(src) - 4 * n:]
        at = rfind_token_run(hay, pattern, end - n + 1)
        if at is None:
            break
        start = at + n
        cont = list(hay_tokens[start:start + k])
        if cont:
            best = (n, cont)
    return best


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self) -> None:
        self.recent: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()
        """request id -> (its output so far, packed)"""

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks):
            tokens = req.token_ids
            own = longest_match(tokens, tokens, pack(tokens), len(tokens) - 1, k)
            best = own
            for rid, (other, packed) in self.recent.items():
                if rid != req.request_id and len(other) > best[0]:
                    found = longest_match(tokens, other, packed, len(other), k)
                    if found[0] > best[0] and len(found[1]) >= len(best[1]):
                        best = found
            out.append(best[1])
            self._remember(req)
        return out

    def _remember(self, req: Request) -> None:
        out = req.output_token_ids
        self.recent[req.request_id] = (out, pack(out))
        self.recent.move_to_end(req.request_id)
        while len(self.recent) > HISTORY:
            self.recent.popitem(last=False)
