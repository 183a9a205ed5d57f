"""Streaming stop-string detection over detokenised text deltas.

A stop string may arrive split over many deltas, so text that could still turn
out to be the start of a stop string is held back: a client must never see a
partial stop string that is later cut from the final output.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas in order; get back what is safe to emit and whether to stop.

    When several stop strings occur, the one that completes first in the stream
    wins (smallest end position; on a tie, the one starting earliest), which is
    what a character-by-character stream would have hit.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops must be non-empty strings, got {s!r}")
        self.stops: tuple[str, ...] = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._stopped = False
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
        hit = self._first_match(text)
        if hit is not None:
            start, stop = hit
            self._stopped, self._held = True, ""
            self.matched = text[start:stop]
            return text[:stop] if self.include_stop_str_in_output else text[:start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, text: str) -> tuple[int, int] | None:
        """(start, end) of the stop string completing first in ``text``, or None."""
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = text.find(s)
            if i < 0:
                continue
            cand = (i + len(s), i)
            if best is None or cand < (best[1], best[0]):
                best = (i, i + len(s))
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
