"""The grammar compiler and the mask: one compile per distinct constraint, errors
that say what is wrong, the shortest-output check, the stop-string guard, and
masks that allow exactly what llguidance allows."""
from __future__ import annotations

import llguidance
import pytest
import torch

from core.guided.compiler import GrammarCompiler, grammar_of
from engine.guided.masks import MaskBuilder, banned
from core.guided.spec import GuidedSpec
from core.sampling.stop import StopStringMatcher
from core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.load(tiny_model_dir))


def test_one_compile_per_distinct_constraint(compiler) -> None:
    a = GuidedSpec.json_schema({"type": "integer"})
    assert compiler._compiled(a) is compiler._compiled(GuidedSpec.json_schema({"type": "integer"}))
    assert compiler._compiled(a) is not compiler._compiled(GuidedSpec.json_schema({"type": "number"}))
    s1, s2 = compiler.start(a), compiler.start(a)
    assert s1.matcher is not s2.matcher  # each request advances its own copy
    assert a.key != GuidedSpec("regex", a.text).key  # the kind is part of the identity


def test_shortest_output_in_tokens(compiler) -> None:
    # byte-level vocabulary: one token per byte; EOS counted where the grammar needs it
    assert compiler.min_tokens(GuidedSpec("regex", "abc")) == 3
    assert compiler.min_tokens(GuidedSpec("regex", "[0-9]{4}")) == 4
    assert compiler.min_tokens(GuidedSpec("regex", "a+")) == 2  # "a", then EOS
    assert compiler.min_tokens(GuidedSpec.choice(["alpha", "be"])) == 2
    assert compiler.min_tokens(GuidedSpec.json_schema({"type": "boolean"})) == 4
    obj = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}
    assert compiler.min_tokens(GuidedSpec.json_schema(obj)) == len('{"k": ""}')


def test_check_names_the_field(compiler) -> None:
    with pytest.raises(ValueError, match="^guided_regex: "):
        compiler.check(GuidedSpec("regex", "[a-"), 10, "guided_regex")
    with pytest.raises(ValueError, match="^max_tokens: 3 is too few for response_format"):
        compiler.check(GuidedSpec("regex", "abcd"), 3, "response_format")
    compiler.check(GuidedSpec("regex", "abcd"), 4, "response_format")
    with pytest.raises(ValueError, match="Unimplemented keys"):
        compiler.check(GuidedSpec.json_schema({"type": "array", "uniqueItems": True}), 9)


def test_accepts_complete_outputs_only(compiler) -> None:
    spec = GuidedSpec.json_schema({"type": "array", "items": {"type": "integer"}})
    assert compiler.accepts(spec, "[1, 2]")
    assert not compiler.accepts(spec, "[1, 2")
    assert not compiler.accepts(spec, '["a"]')


def test_regex_digits_are_ascii(compiler) -> None:
    spec = GuidedSpec("regex", r"\d+")
    assert compiler.accepts(spec, "123") and not compiler.accepts(spec, "١٢٣")
    assert "[0-9]" in grammar_of(spec)


def test_a_refused_token_leaves_an_error_and_nothing_else_is_taken(compiler) -> None:
    state = compiler.start(GuidedSpec("regex", "[0-9]"))
    letter = compiler.tokenizer.encode("x", add_special_tokens=False)[0]
    digit = compiler.tokenizer.encode("7", add_special_tokens=False)[0]
    assert not state.consume(letter) and "x" in state.error
    assert not state.consume(digit) and not state.stopped


def test_masks_ban_exactly_what_the_grammar_refuses(compiler) -> None:
    vocab = compiler.tokenizer.vocab_size
    spec = GuidedSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    guides = [compiler.start(spec), None, compiler.start(GuidedSpec("regex", "[a-c]+"))]
    guides[0].consume(compiler.tokenizer.encode("{", add_special_tokens=False)[0])
    builder = MaskBuilder()
    try:
        mask = builder.result(builder.submit(guides, vocab))
    finally:
        builder.close()
    assert mask.shape == (3, vocab) and mask.dtype == torch.bool
    assert not mask[1].any()  # the unconstrained row is left alone
    for row in (0, 2):
        bias = guides[row].matcher.compute_logit_bias()  # one byte per token: 0 = refused
        want = torch.tensor([b == 0 for b in bias[:vocab]])
        assert torch.equal(mask[row], want)
    assert builder.submit([None, None], vocab) is None  # no constrained row: nothing runs


def test_bitmask_unpacking() -> None:
    words = torch.tensor([[0b101, -1]], dtype=torch.int32)  # tokens 0 and 2; 32..63
    got = banned(words, 40)
    allowed = [i for i in range(40) if not got[0, i]]
    assert allowed == [0, 2, *range(32, 40)]


class _Outside:
    """An Acceptor that takes an output as complete where its quotes balance."""

    def __init__(self, complete=lambda text: text.count('"') % 2 == 0) -> None:
        self.confirmed, self.asked, self.complete = "", [], complete

    def confirm(self, text: str) -> None:
        self.confirmed += text

    def accepts(self, text: str) -> bool:
        self.asked.append(text)
        return self.complete(self.confirmed + text)


def test_stop_strings_inside_a_structure_are_text() -> None:
    outside = _Outside()
    m = StopStringMatcher(["}"], accept=outside)
    assert m.feed('{"a": "x}') == ('{"a": "x}', False)  # "}" inside the string: just text
    assert m.feed('"}') == ('"', True)  # the brace after the string ends it
    # asked only about the text after what it was told (the first feed, once emitted)
    assert outside.asked == ['{"a": "x', '"'] and outside.confirmed == '{"a": "x}'
    guard = StopStringMatcher(["END"], accept=_Outside(lambda t: t.rstrip().endswith(".")))
    assert guard.feed("a END b. E") == ("a END b. ", False)
    assert guard.feed("ND") == ("", True) and guard.matched == "END"


def test_llguidance_tokenizer_agrees_with_ours(compiler) -> None:
    ll = compiler.ll_tokenizer
    ids = compiler.tokenizer.encode('{"x": [1, 2]} héllo', add_special_tokens=False)
    assert ll.decode_bytes(ids) == '{"x": [1, 2]} héllo'.encode()
    assert isinstance(ll, llguidance.LLTokenizer) and ll.vocab_size == compiler.tokenizer.vocab_size


def test_grammars_in_lark_and_gbnf(compiler) -> None:
    lark = GuidedSpec("grammar", 'start: "yes" | "no" DIGITS\nDIGITS: /[0-9]+/')
    gbnf = GuidedSpec("grammar", 'root ::= "yes" | "no" digits\ndigits ::= [0-9]+')
    for spec in (lark, gbnf):
        assert compiler.accepts(spec, "yes") and compiler.accepts(spec, "no42")
        assert not compiler.accepts(spec, "maybe") and not compiler.accepts(spec, "no")
