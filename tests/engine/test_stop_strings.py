"""StopStringMatcher: hold-back of possible stop prefixes, truncation, flush."""
from __future__ import annotations

import pytest

from core.sampling import StopStringMatcher


def _stream(m: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    emitted: list[str] = []
    for d in deltas:
        text, hit = m.feed(d)
        emitted.append(text)
        if hit:
            return emitted, True
    emitted.append(m.flush())
    return emitted, False


FLUSH = None
"""In a script, the step that calls ``flush()`` instead of ``feed``."""

SCRIPTS = [  # (stops, [(delta or FLUSH, what feed/flush returns), ...]), steps in order
    pytest.param((), [("hello", ("hello", False)), (FLUSH, "")], id="no stops pass through"),
    pytest.param(("STOP",), [("a ST", ("a ", False)), ("OR", ("STOR", False)), ("y", ("y", False))],
                 id="false alarm is released"),
    pytest.param(("\n\n",), [("line one\n\nline two", ("line one", True))],
                 id="stop inside one delta"),
    pytest.param(("<|end|>",), [("done <|en", ("done ", False)), (FLUSH, "<|en"), (FLUSH, "")],
                 id="flush releases held text"),
    pytest.param(("xyz", "yq"), [("axy", ("a", False)),  # "xy" could start xyz
                                 ("q", ("x", True))],  # "yq" hit; "x" released before it
                 id="hold back uses the longest candidate prefix"),
]


@pytest.mark.parametrize("stops, script", SCRIPTS)
def test_feed_and_flush_return_what_the_script_says(stops: tuple[str, ...],
                                                    script: list[tuple[str | None, object]]) -> None:
    m = StopStringMatcher(stops)
    got = [m.flush() if delta is FLUSH else m.feed(delta) for delta, _ in script]
    assert got == [want for _, want in script]


def test_partial_prefix_is_held_then_stop_truncates() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("hello ST") == ("hello ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.matched == "STOP"
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""


def test_stop_split_over_many_deltas() -> None:
    m = StopStringMatcher(("</answer>",))
    emitted, hit = _stream(m, list("result</answer>tail"))
    assert hit and "".join(emitted) == "result"
    assert all("<" not in e for e in emitted)


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(("##",), include_stop_str_in_output=True)
    emitted, hit = _stream(m, ["ab#", "#cd"])
    assert hit and "".join(emitted) == "ab##"


def test_overlapping_candidate_restarts_inside_held_text() -> None:
    # "abab" then "c": the first "ab" is a false start, the stop begins at index 2.
    m = StopStringMatcher(("abac",))
    emitted, hit = _stream(m, ["ab", "ab", "ac", "zz"])
    assert hit and "".join(emitted) == "ab"
    m = StopStringMatcher(("aab",))
    emitted, hit = _stream(m, ["a", "a", "a", "a", "b"])
    assert hit and "".join(emitted) == "aa"


def test_multiple_stops_first_to_complete_wins() -> None:
    m = StopStringMatcher(("world", "lo w"))
    emitted, hit = _stream(m, ["hel", "lo wor", "ld"])
    assert hit and "".join(emitted) == "hel" and m.matched == "lo w"
    # Two stops in one delta: the earlier one cuts.
    m = StopStringMatcher(("X", "Y"))
    assert m.feed("aYbX") == ("a", True)
    # Same end: the longer (earlier-starting) one cuts.
    m = StopStringMatcher(("bc", "abc"), include_stop_str_in_output=False)
    assert m.feed("zabcq") == ("z", True)


@pytest.mark.parametrize("bad", [("",), (3,)])
def test_bad_stops_rejected(bad: tuple) -> None:
    with pytest.raises(ValueError, match="stops"):
        StopStringMatcher(bad)


def test_random_chunking_matches_reference() -> None:
    import random
    rng = random.Random(0)
    stops = ("END", "ENDS", "\n---", "ab")
    for _ in range(200):
        text = "".join(rng.choice("EnNDdS\n-ab x") for _ in range(30))
        cuts = sorted(rng.sample(range(1, 30), 5))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, 30])]
        emitted, hit = _stream(StopStringMatcher(stops), deltas)
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        if ends:
            assert hit and "".join(emitted) == text[:min(ends)[1]]
        else:
            assert not hit and "".join(emitted) == text
