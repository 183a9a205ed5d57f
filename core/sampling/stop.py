"""Streaming stop-string detection over detokenised text deltas.

A stop string may arrive split over many deltas, so text that could still turn
out to be the start of a stop string is held back: a client must never see a
partial stop string that is later cut from the final output.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Acceptor(Protocol):
    """For a constrained request: whether the output up to a stop string is complete
    (core/guided/acceptor.py). Told the output as it is confirmed, so each question
    costs only the text after it: the check stays O(new text) per step."""

    def confirm(self, text: str) -> None:
        """The output grew by ``text``: no stop string ends it before text's end."""

    def accepts(self, text: str) -> bool:
        """Whether the output confirmed so far, then ``text``, is complete."""


class StopStringMatcher:
    """Feed text deltas in order; get back what is safe to emit and whether to stop.

    When several stop strings occur, the one that completes first in the stream
    wins (smallest end position; on a tie, the one starting earliest), which is
    what a character-by-character stream would have hit.

    ``accept`` (constrained requests): asked about the output before a match (the
    text since what it was told last); False means the match falls inside the
    structure (a JSON string, say) and is just text, so the search goes on past it.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False,
                 accept: Acceptor | None = None) -> None:
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops must be non-empty strings, got {s!r}")
        self.stops: tuple[str, ...] = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._stopped = False
        self._accept = accept
        self.matched: str | None = None
        """The stop string that ended generation, once one has."""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, stop string hit). After a hit, returns ("", True)."""
        if self._stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        hit = next((m for m in self._matches(text) if self._accepted(text[:m[0]])), None)
        if hit is not None:
            start, stop = hit
            self._stopped, self._held = True, ""
            self.matched = text[start:stop]
            return text[:stop] if self.include_stop_str_in_output else text[:start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        if self._accept is not None:
            self._accept.confirm(text[:len(text) - keep])
        return text[:len(text) - keep], False

    def skip(self, text: str) -> None:
        """The output grew by text no stop string may end in (before min_tokens; nothing
        is held back then): only a constrained request's acceptor hears of it."""
        if text and self._accept is not None:
            self._accept.confirm(text)

    def _accepted(self, before: str) -> bool:
        """before: the text of this feed (held back text first) up to the match."""
        return self._accept is None or self._accept.accepts(before)

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _matches(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of stop strings in ``text``, the one completing first first (on
        a tie, the one starting earliest). Without ``accept`` only the first occurrence
        of each stop string can matter; with it, every occurrence is a candidate."""
        found = []
        for s in self.stops:
            i = text.find(s)
            while i >= 0:
                found.append((i + len(s), i))
                i = text.find(s, i + 1) if self._accept is not None else -1
        return [(i, end) for end, i in sorted(found)]

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
