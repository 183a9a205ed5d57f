"""The shortest output a grammar accepts, and the fewest tokens that spell it: how
the router and the workers tell a max_tokens that can never hold a complete output.

The search runs the grammar over a vocabulary of the 256 bytes (``byte_tokenizer``:
its masks cost microseconds, where the model's 50k-token ones cost up to a
millisecond), shortest output first. Forced bytes (llguidance's
``compute_ff_bytes``) are taken in one move; elsewhere a node expands at most
``BRANCH`` of its allowed bytes, closing characters first (quote, brace, bracket,
zero), and of the children one parent makes, those whose next-byte sets and
accepting flags agree are kept once (inside a string, "a" and "b" lead to the same
place). Inside free text (a string's characters: more than ``FREE_TEXT`` bytes
allowed) it tries a sample of bytes, a space first, and when one of them leaves the
free text (closes the string) it goes only that way: going on cannot be shorter.
Free text it must stay in is spelled with spaces, so the token count leans low
(vocabularies spell long runs of spaces in one token: a max_tokens is refused only
when not even that fits). That pruning makes
the result an estimate from above of the shortest output in bytes, exact for the
schemas, regexes and choices we test. A search that runs past its budgets
(core/guided/budget.py: ``SEARCH_NODES`` nodes, ``SEARCH_SECONDS`` of time, outputs
of ``SEARCH_MAX_BYTES``) gives up (no check), so a grammar is never refused for
being hard to search; each node's masks are bounded by llguidance's per-step fuel,
so the deadline is checked often. Torch-free.
"""
from __future__ import annotations

import heapq
import itertools

import llguidance

from core.guided.budget import SEARCH_MAX_BYTES, SEARCH_NODES, Deadline

BRANCH = 6
FREE_TEXT = 32
"""A node allowing more bytes than this is inside free text (a string's characters)."""
_SAMPLE = b' "}]\n\t0a.,:<E'
"""The bytes tried inside free text (a space first: it is the representative kept)."""
_PREFER = b'"}]0,:1[{ntfa-.e'
"""Bytes tried first where the grammar allows a choice: the ones that close or
complete a JSON value soonest, then common starts of short values."""
_EOS = 256


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus EOS (llguidance's wrapper API)."""

    eos_token_id, bos_token_id, special_token_ids = _EOS, None, [_EOS]
    tokens = [bytes([i]) for i in range(256)] + [b"\xff[EOS]"]  # 0xff marks a special

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _allowed(mask: bytes) -> list[int]:
    """The bytes the mask allows, ascending."""
    return [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]


def _candidates(allowed: list[int]) -> list[int]:
    if len(allowed) > FREE_TEXT:
        return [b for b in _SAMPLE if b in allowed] or allowed[:1]
    first = [b for b in _PREFER if b in allowed]
    rest = [b for b in allowed if b not in _PREFER]
    return (first + rest)[:BRANCH]


def shortest_output(start: llguidance.LLMatcher, deadline: Deadline | None = None
                    ) -> tuple[bytes, bool] | None:
    """(the shortest accepted output found, whether the grammar is then stopped, so no
    EOS is needed), or None when the search gave up or found nothing. start: a fresh
    matcher over ``byte_tokenizer()``."""
    tie = itertools.count()
    heap = [(0, next(tie), b"", start.deep_copy())]
    for _ in range(SEARCH_NODES):
        if not heap or (deadline is not None and deadline.passed):
            return None
        _, _, out, m = heapq.heappop(heap)
        if m.is_accepting():
            return out, m.is_stopped()
        forced = m.compute_ff_bytes()
        if forced:
            if len(out) + len(forced) <= SEARCH_MAX_BYTES and m.consume_tokens(list(forced)):
                heapq.heappush(heap, (len(out) + len(forced), next(tie), out + forced, m))
            continue
        if len(out) < SEARCH_MAX_BYTES:
            for b, child in _children(m):
                heapq.heappush(heap, (len(out) + 1, next(tie), out + bytes([b]), child))
    return None


def _children(m: llguidance.LLMatcher) -> list[tuple[int, llguidance.LLMatcher]]:
    """(byte, matcher one byte on); of siblings whose next-byte sets and accepting flags
    agree, the first only; from free text, only the children that leave it, if any."""
    allowed = _allowed(m.compute_bitmask())
    kept: dict[tuple[bytes, bool], tuple[int, llguidance.LLMatcher]] = {}
    for b in _candidates(allowed):
        child = m.deep_copy()
        if child.consume_token(b):
            kept.setdefault((child.compute_bitmask(), child.is_accepting()), (b, child))
    if len(allowed) > FREE_TEXT:
        leaving = [c for (mask, accepting), c in kept.items()
                   if accepting or len(_allowed(mask)) <= FREE_TEXT]
        return leaving or list(kept.values())
    return list(kept.values())


def fewest_tokens(data: bytes, token_bytes: frozenset[bytes], longest: int,
                  deadline: Deadline | None = None) -> int:
    """The fewest tokens whose bytes concatenate to ``data`` (a matcher accepts any
    tokenization, not only the canonical one). Past the deadline: a lower bound (no
    token is longer than ``longest`` bytes)."""
    inf = len(data) + 1
    best = [0] + [inf] * len(data)
    for i in range(1, len(data) + 1):
        if i % 1024 == 0 and deadline is not None and deadline.passed:
            return -(-len(data) // longest)
        for j in range(max(0, i - longest), i):
            if best[j] + 1 < best[i] and data[j:i] in token_bytes:
                best[i] = best[j] + 1
    return best[-1]
