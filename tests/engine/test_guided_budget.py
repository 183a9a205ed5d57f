"""What checking a constraint may cost (core/guided/budget.py): a build past its
time budget and a JSON text nested past its depth budget are ValueErrors naming the
field and the budget; a search past its deadline gives up; and the stop-string check
of a constrained output is linear in the output, counted in the tokens its matchers
are given."""
from __future__ import annotations

import json

import llguidance
import pytest

from core.guided.budget import COMPILE_SECONDS, MAX_JSON_DEPTH, Deadline, json_depth
from core.guided.compiler import GrammarCompiler, check_schema, grammar_of
from core.guided.search import byte_tokenizer, fewest_tokens, shortest_output
from core.guided.spec import GuidedSpec
from core.sampling.stop import StopStringMatcher
from core.tokenizer import Tokenizer
from tests.guided_cases import COSTLY_TO_COMPILE


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.load(tiny_model_dir))


def _nested(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def test_a_build_past_its_time_budget_is_refused_naming_the_field(compiler) -> None:
    spec = GuidedSpec.json_schema(COSTLY_TO_COMPILE)
    with pytest.raises(ValueError) as e:
        compiler.check(spec, 100, "response_format")
    assert str(e.value) == (f"response_format: takes more than {COMPILE_SECONDS:g} s to "
                            "compile (the budget)")
    compiler.check(GuidedSpec.json_schema({"type": "integer"}), 100, "response_format")


def test_deep_nesting_is_a_value_error_naming_the_field(compiler) -> None:
    assert json_depth(json.loads(_nested(MAX_JSON_DEPTH - 1))) == MAX_JSON_DEPTH
    compiler.check(GuidedSpec("json_schema", _nested(MAX_JSON_DEPTH - 1)), 100, "guided_json")
    with pytest.raises(ValueError, match=f"^guided_json: nests {MAX_JSON_DEPTH + 2} levels "
                                         f"deep; the budget is {MAX_JSON_DEPTH} levels$"):
        compiler.check(GuidedSpec("json_schema", _nested(MAX_JSON_DEPTH + 1)), 100, "guided_json")
    # past what Python's JSON parser can take (RecursionError before)
    with pytest.raises(ValueError, match=f"^response_format: nests too deeply; the budget "
                                         f"is {MAX_JSON_DEPTH} levels$"):
        compiler.check(GuidedSpec("json_schema", _nested(5000)), 100, "response_format")
    with pytest.raises(ValueError, match="^guided_choice: nests too deeply"):
        compiler.check(GuidedSpec("choice", "[" * 5000 + "]" * 5000), 100, "guided_choice")
    # a tool's parameters (the router checks them with check_schema)
    deep = json.loads(_nested(200))
    with pytest.raises(ValueError, match=f"^nests 201 levels deep; the budget is {MAX_JSON_DEPTH}"):
        check_schema(deep)
    with pytest.raises(ValueError, match="^tools.0.function.parameters: nests 201 levels deep"):
        compiler.check(GuidedSpec.json_schema({"type": "integer"}), 100, "tools",
                       schemas=[("tools.0.function.parameters", deep)])


def test_a_search_past_its_deadline_gives_up() -> None:
    grammar = grammar_of(GuidedSpec("regex", "[0-9]{4}"))
    start = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    assert shortest_output(start) == (b"0000", True)
    assert shortest_output(start, Deadline(0)) is None  # no check rather than a stall
    tokens = frozenset({b"a", b"aa", b"aaaa"})
    assert fewest_tokens(b"a" * 4096, tokens, 4) == 1024
    assert fewest_tokens(b"a" * 4095, tokens, 4) == 1025
    assert fewest_tokens(b"a" * 4095, tokens, 4, Deadline(0)) == 1024  # a lower bound


class _Counting:
    """An LLMatcher that counts the tokens it is given to consume."""

    def __init__(self, matcher: llguidance.LLMatcher, given: list[int]) -> None:
        self._matcher, self._given = matcher, given

    def consume_tokens(self, ids: list[int]) -> bool:
        self._given[0] += len(ids)
        return self._matcher.consume_tokens(ids)

    def try_consume_tokens(self, ids: list[int]) -> int:
        self._given[0] += len(ids)
        return self._matcher.try_consume_tokens(ids)

    def deep_copy(self) -> _Counting:
        return _Counting(self._matcher.deep_copy(), self._given)

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


def test_the_stop_string_check_is_linear_in_the_output(compiler, monkeypatch) -> None:
    """200 stop strings inside a JSON string, fed a few characters at a time: each is
    only text, and the matchers are given about the output once (before: the whole
    output so far for each occurrence, about 100 times the output)."""
    spec = GuidedSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}},
                                   "required": ["s"]})
    given, start = [0], compiler.start

    def counting_start(s: GuidedSpec):
        state = start(s)
        state.matcher = _Counting(state.matcher, given)
        return state
    monkeypatch.setattr(compiler, "start", counting_start)
    output = '{"s": "' + "a STOP b " * 200 + '"}'
    stops = StopStringMatcher(["STOP"], accept=compiler.acceptor(spec, ["STOP"]))
    pieces = [(output + "STOP and on")[i:i + 4] for i in range(0, len(output) + 11, 4)]
    emitted = "".join(stops.feed(p)[0] for p in pieces if not stops.stopped)
    assert emitted == output and stops.matched == "STOP"  # the one after the object
    tokens = len(compiler.ll_tokenizer.tokenize_bytes(output.encode()))
    assert tokens <= given[0] <= 2 * tokens
