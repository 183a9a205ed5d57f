"""The suffix proposer's automata (engine/spec/suffix.py): the longest repeated suffix
and the longest match in the history are what a brute-force search finds, guesses
continue the first occurrence, only finished requests' outputs are history, no match
spans two outputs, and the history keeps the newest outputs within its token budget."""
from __future__ import annotations

import random

from engine.request import Request, RequestStatus
from core.sampling import SamplingParams
from engine.spec import suffix as sx


def brute_repeated(t: list[int]) -> tuple[int, int]:
    for n in range(len(t) - 1, 0, -1):
        for e in range(n - 1, len(t) - 1):
            if t[e - n + 1:e + 1] == t[len(t) - n:]:
                return n, e
    return 0, -1


def brute_match(text: list[int], q: list[int]) -> int:
    for n in range(len(q), 0, -1):
        if any(text[i:i + n] == q[len(q) - n:] for i in range(len(text) - n + 1)):
            return n
    return 0


def test_the_automaton_finds_what_a_brute_force_search_finds() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sam, toks = sx.SuffixAutomaton(), []
        for _ in range(rng.randint(1, 50)):
            toks.append(rng.randint(0, 3))
            sam.extend(toks[-1])
            assert sam.repeated_suffix() == brute_repeated(toks)
        q = [rng.randint(0, 3) for _ in range(rng.randint(1, 10))]
        n, end = sam.match(q)
        assert n == brute_match(toks, q)
        assert n == 0 or toks[end - n + 1:end + 1] == q[len(q) - n:]


def _req(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64))
    r.status = RequestStatus.RUNNING
    r.token_ids = list(prompt) + list(output)  # output_token_ids: what follows the prompt
    return r


def test_guesses_continue_own_text_and_finished_outputs_only() -> None:
    p = sx.SuffixProposer()
    # own text: "10 11 12 13 14 ... 10 11" -> 12 13 14
    a = _req("a", [10, 11, 12, 13, 14, 15, 9, 10, 11])
    assert p.propose([a], [3]) == [[12, 13, 14]]
    a.token_ids += [12]  # committed since: the automaton is extended, not rebuilt
    assert p.propose([a], [2]) == [[13, 14]]
    # another request's output is history only once it finished
    b = _req("b", [1, 2], output=[50, 51, 52, 53, 54])
    c = _req("c", [7, 50, 51, 52])
    p.propose([b], [1])
    assert p.propose([c], [2]) == [[]]
    b.status = RequestStatus.FINISHED
    assert p.propose([c], [2]) == [[53, 54]]
    # no match spans two outputs: the guess stops at the separator
    d = _req("d", [3], output=[60, 61])
    p.propose([d], [1])
    d.status = RequestStatus.FINISHED
    e = _req("e", [8, 53, 54])
    assert p.propose([e], [3]) == [[]]  # 53 54 ended b's output: nothing after them


def test_the_history_keeps_the_newest_outputs_within_its_budget(monkeypatch) -> None:
    monkeypatch.setattr(sx, "HISTORY_TOKENS", 10)
    p = sx.SuffixProposer()
    for i in range(6):
        r = _req(f"r{i}", [1], output=[100 * i + j for j in range(4)])
        p.propose([r], [1])
        r.status = RequestStatus.FINISHED
        p.propose([], [])
    # 5 outputs made 25 tokens with separators (> 2 x 10): rebuilt from the newest two
    # (8 tokens within 10), then the sixth joined
    assert p.histories[b""].outputs == [[100 * i + j for j in range(4)] for i in (3, 4, 5)]
    assert p.histories[b""].size == 15 and p.live == {}


def test_a_request_draws_only_on_outputs_under_its_own_salt() -> None:
    """Guesses from another tenant's outputs would be accepted faster when right, so
    their timing would tell what another tenant was told: each salt has its own history."""
    p = sx.SuffixProposer()
    a = _req("a", [1, 2], output=[70, 71, 72, 73, 74])
    a.cache_salt = b"tenant-a"
    p.propose([a], [1])
    a.status = RequestStatus.FINISHED
    b = _req("b", [7, 70, 71, 72])
    b.cache_salt = b"tenant-b"
    assert p.propose([b], [2]) == [[]]  # a's output is no history of b's salt
    plain = _req("plain", [7, 70, 71, 72])
    assert p.propose([plain], [2]) == [[]]  # nor of the unsalted (open router) cache
    a2 = _req("a2", [7, 70, 71, 72])
    a2.cache_salt = b"tenant-a"
    assert p.propose([a2], [2]) == [[73, 74]]  # under its own salt it is


def test_the_histories_stay_within_one_budget_least_recently_used_first(monkeypatch) -> None:
    monkeypatch.setattr(sx, "HISTORY_TOKENS", 10)
    monkeypatch.setattr(sx, "MAX_HISTORIES", 3)
    p = sx.SuffixProposer()

    def finish(rid: str, salt: bytes, output: list[int]) -> None:
        r = _req(rid, [1], output=output)
        r.cache_salt = salt
        p.propose([r], [1])
        r.status = RequestStatus.FINISHED
        p.propose([], [])

    for i, salt in enumerate((b"s0", b"s1", b"s2", b"s3")):
        finish(f"r{i}", salt, [10 * i, 10 * i + 1, 10 * i + 2])  # 4 tokens with its separator
    assert list(p.histories) == [b"s1", b"s2", b"s3"]  # at most 3 salts: s0 went
    finish("big", b"s1", list(range(100, 114)))  # its last 10 tokens (+1) join s1: 23 > 20
    assert list(p.histories) == [b"s3", b"s1"]  # the least recently used, s2, went
    assert [h.size for h in p.histories.values()] == [4, 15]
