"""N-gram prompt lookup: match the context's last n tokens earlier in the context
(prompt and output) and propose what followed the most recent match.

Model-free and cheap: the search runs in C (bytes.rfind over the tokens packed as
4-byte words). Strong where the output copies the input: code edits, extraction,
answers and summaries that quote.
"""
from __future__ import annotations

from array import array
from typing import Sequence

from engine.request import Request
from engine.spec.base import Proposer

MAX_NGRAM = 4
MIN_NGRAM = 2


def pack(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def rfind_token_run(hay: bytes, pattern: bytes, end: int) -> int | None:
    """Token index of the last occurrence of ``pattern`` (packed tokens) that starts
    before token ``end``, aligned to whole tokens; None when there is none."""
    stop = end * 4 + len(pattern) - 4
    while True:
        i = hay.rfind(pattern, 0, stop)
        if i < 0:
            return None
        if i % 4 == 0:
            return i // 4
        stop = i + len(pattern) - 1  # a misaligned hit: look further left


def continuation(tokens: Sequence[int], hay: bytes, n: int, k: int) -> list[int]:
    """Up to k tokens that followed the last earlier occurrence of tokens[-n:]."""
    size = len(tokens)
    if size <= n:
        return []
    pattern = hay[(size - n) * 4:]
    # the latest match followed by k whole tokens; else the latest match (in a run that
    # repeats one token, the latest match is followed by a single token)
    at = rfind_token_run(hay, pattern, size - n - k + 1) if size - n - k + 1 > 0 else None
    if at is None:
        at = rfind_token_run(hay, pattern, size - n)
    if at is None:
        return []
    start = at + n
    return list(tokens[start:start + k])


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_ngram: int | None = None, min_ngram: int | None = None) -> None:
        self.max_ngram = max_ngram or MAX_NGRAM
        self.min_ngram = min_ngram or MIN_NGRAM

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks):
            tokens = req.token_ids
            hay = pack(tokens)
            guess: list[int] = []
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                guess = continuation(tokens, hay, n, k)
                if guess:
                    break
            out.append(guess)
        return out
