"""Suffix decoding (after Arctic's SuffixDecoding): find the longest suffix of the
context that occurred before, in the request's own prompt and output or in the outputs
of recently finished requests, and propose what followed it.

The structure is a suffix automaton (SuffixAutomaton: every substring of a text is a
path from its root, built online in amortised O(1) per token), one per request over its
tokens, extended with the tokens each step committed, and one over the recent outputs
of each cache salt (the last HISTORY_TOKENS tokens' worth, separated so that no match
crosses two). The longest suffix of a request's own text that occurred earlier is a
lookup (the last state's suffix link); in the history it is a walk over the context's
last MAX_MATCH tokens.

A request draws only on the outputs of finished requests under its own cache salt
(Request.cache_salt: the tenant's): guesses that come from another tenant's outputs
would be accepted faster, and that speed would tell which outputs it produced. The
histories share one budget, so memory stays bounded however many tenants come: at most
MAX_HISTORIES salts and 2 x HISTORY_TOKENS tokens in all, the least recently used
salt's history dropped first. The longer the
match, the likelier the continuation repeats; n-gram lookup (ngram.py) stops at 4 tokens
and sees only its own request. We write our own (a few dozen lines of Python): no
maintained package offers an incremental one over integer tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.request import Request, RequestStatus
from engine.spec.base import Proposer

MAX_MATCH = 32
"""Context tokens matched against the history (own matches are unbounded)."""
MIN_MATCH = 2
"""A shorter match (one repeated token) proposes nothing."""
HISTORY_TOKENS = 16384
"""Tokens of finished requests' outputs kept for matching (the most recent outputs)."""
LIVE = 256
"""Requests whose automata are kept (the most recently speculating)."""
MAX_HISTORIES = 64
"""Cache salts whose finished outputs are kept (the most recently used)."""


class SuffixAutomaton:
    """Suffix automaton of a token sequence, extended one token at a time. State v
    stands for a set of substrings, the longest length[v] tokens, all of which end first
    at position first[v]; link[v] is the state of its longest suffix in another set."""

    __slots__ = ("next", "link", "length", "first", "last", "tokens")

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.first = [-1], [0], [-1]
        self.last = 0
        self.tokens: list[int] = []

    def _state(self, length: int, first: int, link: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.length) - 1

    def extend(self, token: int) -> None:
        nxt, length = self.next, self.length
        cur = self._state(length[self.last] + 1, len(self.tokens), 0, {})
        self.tokens.append(token)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                self.link[cur] = q
            else:  # split q: the strings up to length[p] + 1 get a state of their own
                clone = self._state(length[p] + 1, self.first[q], self.link[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def repeated_suffix(self) -> tuple[int, int]:
        """(length, end position of its first occurrence) of the longest suffix of the
        text that also occurs earlier; (0, -1) when none does."""
        v = self.link[self.last]
        return (self.length[v], self.first[v]) if v > 0 else (0, -1)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """(length, end position of its first occurrence here) of the longest suffix of
        ``tokens`` that occurs in this text."""
        v, n = 0, 0
        for t in tokens:
            while v and t not in self.next[v]:
                v = self.link[v]
                n = self.length[v]
            if t in self.next[v]:
                v, n = self.next[v][t], n + 1
        return (n, self.first[v]) if n else (0, -1)

    def after(self, end: int, k: int) -> list[int]:
        """Up to k tokens after position ``end``, stopping at a separator (< 0)."""
        out = []
        for t in self.tokens[end + 1:end + 1 + k]:
            if t < 0:
                break
            out.append(t)
        return out


class History:
    """The finished outputs of one cache salt, oldest first, and their automaton."""

    def __init__(self, outputs: Sequence[list[int]] = ()) -> None:
        self.outputs: list[list[int]] = []
        self.sam = SuffixAutomaton()
        for o in outputs:
            self.add(o)

    def add(self, output: list[int]) -> None:
        self.outputs.append(output)
        for t in output:
            self.sam.extend(t)
        self.sam.extend(-len(self.outputs))  # a separator no token equals: no match spans two

    @property
    def size(self) -> int:
        return len(self.sam.tokens)

    def newest(self, budget: int) -> History:
        """A history of the newest outputs within ``budget`` tokens."""
        kept, total = [], 0
        for o in reversed(self.outputs):
            if total + len(o) > budget:
                break
            kept.append(o)
            total += len(o)
        return History(kept[::-1])


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self) -> None:
        self.live: OrderedDict[str, tuple[Request, SuffixAutomaton]] = OrderedDict()
        """request id -> (the request, the automaton of its tokens so far)"""
        self.histories: OrderedDict[bytes, History] = OrderedDict()
        """cache salt -> its finished requests' outputs (least recently used first)."""

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        self._retire()
        out = []
        for req, k in zip(reqs, ks):
            own = self._own(req)
            n, end = own.repeated_suffix()
            guess = own.after(end, k) if n >= MIN_MATCH else []
            history = self.histories.get(req.cache_salt)
            if history is not None:
                self.histories.move_to_end(req.cache_salt)
                m, at = history.sam.match(req.token_ids[-MAX_MATCH:])
                if m >= MIN_MATCH and m > n:
                    guess = history.sam.after(at, k) or guess
            out.append(guess)
        return out

    def _own(self, req: Request) -> SuffixAutomaton:
        """The request's automaton, extended with the tokens committed since last time
        (rebuilt for a new request under an id seen before)."""
        entry = self.live.get(req.request_id)
        if entry is None or entry[0] is not req:
            entry = (req, SuffixAutomaton())
            self.live[req.request_id] = entry
        self.live.move_to_end(req.request_id)
        sam = entry[1]
        for t in req.token_ids[len(sam.tokens):]:
            sam.extend(t)
        while len(self.live) > LIVE:
            self.live.popitem(last=False)
        return sam

    def _retire(self) -> None:
        """Finished requests' outputs join their salt's history; then the budget holds:
        a history that alone passes 2 x HISTORY_TOKENS is rebuilt from its newest
        outputs, and while all of them pass it (or there are more than MAX_HISTORIES),
        the least recently used salt's history goes."""
        done = [rid for rid, (r, _) in self.live.items() if r.status is RequestStatus.FINISHED]
        for rid in done:
            req, _ = self.live.pop(rid)
            if req.output_token_ids:
                history = self.histories.setdefault(req.cache_salt, History())
                self.histories.move_to_end(req.cache_salt)
                history.add(list(req.output_token_ids)[-HISTORY_TOKENS:])
        for salt, history in list(self.histories.items()):
            if history.size > 2 * HISTORY_TOKENS:
                self.histories[salt] = history.newest(HISTORY_TOKENS)
        while len(self.histories) > 1 and (
                len(self.histories) > MAX_HISTORIES
                or sum(h.size for h in self.histories.values()) > 2 * HISTORY_TOKENS):
            self.histories.popitem(last=False)

    def forget(self) -> None:
        """Drop every request's automaton and the histories of finished requests'
        outputs (benchmarks, between rounds of the same prompts)."""
        self.live.clear()
        self.histories.clear()
