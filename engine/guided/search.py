"""The shortest output a grammar accepts, and the fewest tokens that spell it: how
the router and the workers tell a max_tokens that can never hold a complete output.

The search walks the matcher one byte at a time (the single-byte tokens of a
byte-level vocabulary), shortest first. Forced bytes (llguidance's
``compute_ff_bytes``) are taken in one move; elsewhere a node expands at most
``BRANCH`` of its allowed bytes, closing characters first (quote, brace, bracket,
zero), and of the children one parent makes, those whose next-byte sets and
accepting flags agree are kept once (inside a string, "a" and "b" lead to the same
place). That pruning makes the result an estimate from above of the shortest
output in bytes, exact for the schemas, regexes and choices we test; a search that
runs past ``NODE_BUDGET`` nodes gives up (no check), so a grammar is never refused
for being hard to search. Torch-free.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

import llguidance

BRANCH = 6
NODE_BUDGET = 4000
_PREFER = b'"}]0,:1[{ntfa-.e'
"""Bytes tried first where the grammar allows a choice: the ones that close or
complete a JSON value soonest, then common starts of short values."""


def _allowed(mask: bytes, byte_tokens: Mapping[int, int]) -> list[int]:
    """The bytes whose single-byte token the mask allows, ascending."""
    return [b for b, t in byte_tokens.items() if mask[t >> 3] >> (t & 7) & 1]


def _candidates(allowed: list[int]) -> list[int]:
    first = [b for b in _PREFER if b in allowed]
    rest = [b for b in allowed if b not in _PREFER]
    return (first + rest)[:BRANCH]


def _consume(m: llguidance.LLMatcher, data: bytes, byte_tokens: Mapping[int, int]) -> bool:
    for b in data:
        t = byte_tokens.get(b)
        if t is None or not m.consume_token(t):
            return False
    return True


def shortest_output(start: llguidance.LLMatcher, byte_tokens: Mapping[int, int]
                    ) -> tuple[bytes, bool] | None:
    """(the shortest accepted output found, whether the grammar is then stopped, so
    no EOS is needed), or None when the search gave up or found nothing.
    byte_tokens: byte value -> the id of the token that is exactly that byte."""
    tie = itertools.count()
    heap: list[tuple[int, int, bytes, llguidance.LLMatcher]] = [(0, next(tie), b"", start.deep_copy())]
    for _ in range(NODE_BUDGET):
        if not heap:
            return None
        _, _, out, m = heapq.heappop(heap)
        if m.is_accepting():
            return out, m.is_stopped()
        forced = m.compute_ff_bytes()
        if forced:
            if _consume(m, forced, byte_tokens):
                heapq.heappush(heap, (len(out) + len(forced), next(tie), out + forced, m))
            continue
        seen: set[tuple[bytes, bool]] = set()
        for b in _candidates(_allowed(m.compute_bitmask(), byte_tokens)):
            child = m.deep_copy()
            if not _consume(child, bytes([b]), byte_tokens):
                continue
            sig = (child.compute_bitmask(), child.is_accepting())
            if sig not in seen:
                seen.add(sig)
                heapq.heappush(heap, (len(out) + 1, next(tie), out + bytes([b]), child))
    return None


def fewest_tokens(data: bytes, token_bytes: frozenset[bytes], longest: int) -> int:
    """The fewest tokens whose bytes concatenate to ``data`` (a matcher accepts any
    tokenization, not only the canonical one)."""
    inf = len(data) + 1
    best = [0] + [inf] * len(data)
    for i in range(1, len(data) + 1):
        for j in range(max(0, i - longest), i):
            if best[j] + 1 < best[i] and data[j:i] in token_bytes:
                best[i] = best[j] + 1
    return best[-1]
