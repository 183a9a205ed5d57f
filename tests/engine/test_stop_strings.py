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


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher(())
    assert m.feed("hello") == ("hello", False)
    assert m.flush() == ""


def test_partial_prefix_is_held_then_stop_truncates() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("hello ST") == ("hello ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.matched == "STOP"
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""


def test_false_alarm_is_released() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("OR") == ("STOR", False)
    assert m.feed("y") == ("y", False)


def test_stop_split_over_many_deltas() -> None:
    m = StopStringMatcher(("</answer>",))
    emitted, hit = _stream(m, list("result</answer>tail"))
    assert hit and "".join(emitted) == "result"
    assert all("<" not in e for e in emitted)


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(("##",), include_stop_str_in_output=True)
    emitted, hit = _stream(m, ["ab#", "#cd"])
    assert hit and "".join(emitted) == "ab##"


def test_stop_inside_one_delta() -> None:
    m = StopStringMatcher(("\n\n",))
    assert m.feed("line one\n\nline two") == ("line one", True)


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(("<|end|>",))
    assert m.feed("done <|en") == ("done ", False)
    assert m.flush() == "<|en"
    assert m.flush() == ""


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


def test_hold_back_uses_longest_candidate_prefix() -> None:
    m = StopStringMatcher(("xyz", "yq"))
    assert m.feed("axy") == ("a", False)  # "xy" could start xyz
    assert m.feed("q") == ("x", True)  # "yq" hit; "x" released before it


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
