"""SentencePiece ("llama") GGUF vocabularies against sentencepiece itself.

Two tiny SentencePiece BPE models are trained here with byte fallback, one as Llama 2 and
Mistral are set up (a leading "▁" on each text) and one as Gemma is (none), written to a
GGUF the way llama.cpp's converter writes a tokenizer.model (tests/models/gguf_files.py),
and read back by ``Tokenizer.from_gguf``: its ids must equal sentencepiece's own encode.

Special tokens inside text: sentencepiece matches user-defined pieces but adds its dummy
prefix only at the start of the whole text, while llama.cpp (and transformers on the same
GGUF) give every run of text after a special token its own leading "▁", as Llama 2's
reference code does by encoding each run apart. So with a prefix the reference encodes
the runs between special tokens one by one and joins them with the specials' ids;
without one (Gemma) the two agree and the reference is one encode of the whole text.
"""
from __future__ import annotations

import random
import re
from pathlib import Path
import pytest

from core.tokenizer import IncrementalDetokenizer, Tokenizer

sentencepiece = pytest.importorskip("sentencepiece")

CONTROL = ("<start_of_turn>", "<end_of_turn>")
"""User-defined pieces the GGUF marks as control tokens (as Gemma's converter output does)."""
USER = ("<tool>",)
"""A user-defined piece left user-defined: matched in text, not special."""
SPECIALS = re.compile("|".join(re.escape(t) for t in (*CONTROL, *USER)))

WORDS = ("the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun "
         "token tokenizer tokens merge merges score scores piece pieces byte bytes fallback "
         "hello world Hello World model models serving server servers request requests").split()
PUNCT = list(".,;:!?()[]{}'\"-_/*+=<>#@%&")
ACCENTED = ["café", "naïve", "façade", "jalapeño", "Straße", "über", "résumé", "Ångström"]
CJK = ["漢字", "日本語", "中文", "你好", "世界", "한국어"]
UNSEEN = ["😀", "👍🏽", "🤖", "Привет", "Ελληνικά", "مرحبا", "龍", "€", "\u200d", "ß̈"]
"""Characters the training text never holds: they reach ids only through byte fallback."""


def _training_text(rng: random.Random) -> list[str]:
    """About 6 KB of lines: words, digits, punctuation, space runs, accents, CJK."""
    lines = []
    for _ in range(120):
        parts = []
        for _ in range(rng.randint(3, 12)):
            kind = rng.random()
            parts.append(rng.choice(WORDS) if kind < 0.6 else rng.choice(PUNCT) if kind < 0.7
                         else str(rng.randrange(10 ** rng.randint(1, 5))) if kind < 0.8
                         else rng.choice(ACCENTED) if kind < 0.9 else rng.choice(CJK))
        lines.append(rng.choice([" ", " ", " ", "  ", "   "]).join(parts))
    lines += [f"{a}{b}" for a in CONTROL + USER for b in ("user", " model", "hi")]
    return lines


FIXED = ["", " ", "  ", "   leading", "trailing   ", " both ", "a", "Hello world", "hello  world   again",
         "line one\nline two", "\n", "\n\nafter blank lines\n", "tab\there", "café naïve Straße",
         "你好，世界。", "12345 678", "3.14159, 2.71828!", "emoji 😀 and 👍🏽", "🤖", "Привет мир",
         "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
         "text before<start_of_turn>after", " <end_of_turn> ", "<start_of_turn><end_of_turn>",
         "call <tool> now", "<tool>", "mixed 漢字 and ascii  with   spaces", "{\"key\": [1, 2, 3]}",
         "the the the the", "merge merges merged merging", "a\u200db", "ß̈ü€"]


def _strings() -> list[str]:
    rng = random.Random(7)
    pools = [WORDS, WORDS, PUNCT, ACCENTED, CJK, UNSEEN, [" ", "  ", "\n", "\t", " \n "],
             [*CONTROL, *USER]]
    out = list(FIXED)
    while len(out) < 80:
        sep = rng.choice(["", " ", " ", "  ", "\n"])
        out.append(sep.join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 10))))
    return out


STRINGS = _strings()


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def pair(request, tmp_path_factory) -> tuple[Tokenizer, object, bool]:
    """(our Tokenizer from the GGUF, sentencepiece on the same model, whether it prefixes)."""
    from tests.models.gguf_files import write_tokenizer_gguf
    from tests.utils import train_sentencepiece

    root = tmp_path_factory.mktemp("spm")
    model = root / "tokenizer.model"
    model.write_bytes(train_sentencepiece(_training_text(random.Random(3)), 480,
                                          add_dummy_prefix=request.param,
                                          user_defined=(*CONTROL, *USER)))
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(model, root / "vocab.gguf", control=CONTROL))
    return tok, sentencepiece.SentencePieceProcessor(model_file=str(model)), request.param


def _reference(sp, text: str, prefix: bool) -> list[int]:
    """sentencepiece's ids for text, with the BOS the GGUF asks for (see the docstring)."""
    if not prefix:
        return [sp.bos_id(), *sp.encode(text)]
    ids, at = [sp.bos_id()], 0
    for m in SPECIALS.finditer(text):
        ids += [*sp.encode(text[at:m.start()]), sp.piece_to_id(m.group())]
        at = m.end()
    return ids + sp.encode(text[at:])


def test_strings_exercise_byte_fallback_and_specials(pair) -> None:
    tok, sp, _ = pair
    byte_ids = {i for i in range(sp.get_piece_size()) if sp.is_byte(i)}
    assert len(STRINGS) >= 30
    assert sum(bool(byte_ids & set(tok.encode(s))) for s in STRINGS) >= 10
    assert sum(bool(SPECIALS.search(s)) for s in STRINGS) >= 10
    assert any(len(tok.encode(s, add_special_tokens=False)) < len(s) - 3 for s in STRINGS)  # merges ran


def test_ids_equal_sentencepiece(pair) -> None:
    tok, sp, prefix = pair
    assert tok.add_bos and tok.bos_token_id == sp.bos_id() == 1
    bad = [(s, tok.encode(s), _reference(sp, s, prefix)) for s in STRINGS
           if tok.encode(s) != _reference(sp, s, prefix)]
    assert not bad, f"{len(bad)} of {len(STRINGS)} differ, first: {bad[:2]!r}"
    plain = [s for s in STRINGS if not SPECIALS.search(s)]  # one encode of the whole text
    assert all(tok.encode(s, add_special_tokens=False) == sp.encode(s) for s in plain)


def test_decode_round_trips(pair) -> None:
    tok, sp, prefix = pair
    for s in STRINGS:
        ids = tok.encode(s)
        if not SPECIALS.search(s):
            assert tok.decode(ids) == sp.decode(ids) == s, s
        elif not prefix:
            assert tok.decode(ids[1:], skip_special_tokens=False) == s, s
    # With a prefix, a run after a special token decodes with the space its "▁" stands for.
    ids = tok.encode("<start_of_turn>hi")
    assert tok.decode(ids, skip_special_tokens=False) == ("<s><start_of_turn> hi" if prefix else "<s><start_of_turn>hi")


def test_streaming_equals_decode(pair) -> None:
    """IncrementalDetokenizer after a prompt: the deltas are what decoding the whole
    sequence adds to the prompt's text, byte-fallback characters never split."""
    tok, _, _ = pair
    prompt = tok.encode("<start_of_turn>user\n")
    for s in STRINGS:
        ids = tok.encode(s, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add(i) for i in ids]
        assert detok.flush() == "" and "\ufffd" not in "".join(deltas), (s, deltas)
        whole, head = tok.decode(prompt + ids), tok.decode(prompt)
        assert whole.startswith(head) and "".join(deltas) == whole[len(head):], (s, deltas)


def test_special_tokens_and_vocabulary(pair) -> None:
    tok, sp, _ = pair
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok.vocab_size == sp.get_piece_size()
    sot = sp.piece_to_id("<start_of_turn>")
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [sot]
    assert tok.decode([sot]) == "" and tok.decode([sot], skip_special_tokens=False) == "<start_of_turn>"
    assert tok.decode([sp.piece_to_id("<tool>")]) == "<tool>"  # user-defined: text, not special


def test_missing_scores_are_named(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "noscores.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores"):
        Tokenizer.load(path)
