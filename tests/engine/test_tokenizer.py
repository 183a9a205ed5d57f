"""Tokenizer parity with the Hugging Face reference, and streaming detokenisation.

The reference is transformers' own GGUF tokenizer for the same file: if we
tokenize differently from it, prompts differ from what users of transformers
(and our own HF-directory path) get for the same model.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from core.tokenizer import IncrementalDetokenizer, Tokenizer

WORDS = ["the", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "world", "don't",
         "I'll", "they're", "API", "tokenizer", "def", "return", "x_1", "foo.bar()", "e-mail", "C++", "œuvre"]
PUNCT = [".", ",", "!", "?", ";", ":", "...", "--", "(", ")", "[", "]", "{", "}", "'", '"', "`", "#", "@",
         "$", "%", "^", "&", "*", "/", "\\", "|", "~", "<", ">", "=", "+", "-", "_"]
ACCENTS = ["café", "naïve", "Ångström", "façade", "jalapeño", "Straße", "e\u0301", "ñ",
           "Ελληνικά", "Привет"]
EMOJI = ["😀", "👍", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇫🇷", "❤\ufe0f", "🤖",
         "🧑\u200d💻"]
CJK = ["漢字", "日本語", "中文分词", "한국어", "ひらがな", "カタカナ", "你好，世界。"]
ARABIC = ["مرحبا", "بالعالم", "العربية", "שלום"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\t\t", "    ", " \t \n "]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_start|>user\n"]
FIXED = ["", " ", "\n", "a", " a", "a ", "  leading", "trailing  ", "a  1", "x   22\t3", "1234567890" * 4,
         "<|im_start|>assistant\nHi!<|im_end|>", "🙂", " 🙂", "👨\u200d👩\u200d👧", "\ufeffbom", "tab\there"]


def _piece(rng: random.Random) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randint(1, 4)))
    if kind == 1:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(8, 40)))
    pools = [WORDS, WORDS, PUNCT, ACCENTS, EMOJI, CJK, ARABIC, SPACES, SPECIALS]
    return rng.choice(pools[kind - 1] if kind > 1 else WORDS)


def make_corpus(n: int = 600, seed: int = 1234) -> list[str]:
    """Deterministic mix of scripts, digits, whitespace runs and special tokens."""
    rng = random.Random(seed)
    out = list(FIXED)
    while len(out) < n:
        sep = rng.choice(["", " ", " ", " ", "\n", "  ", "\t"])
        text = sep.join(_piece(rng) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.2:
            text = rng.choice(SPACES) + text
        if rng.random() < 0.2:
            text += rng.choice(SPACES)
        out.append(text)
    return out


CORPUS = make_corpus()


def _mismatches(pairs: list[tuple[str, object, object]]) -> str:
    bad = [(s, a, b) for s, a, b in pairs if a != b]
    return f"{len(bad)} mismatches, first: {bad[:3]!r}" if bad else ""


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 500 and len(set(CORPUS)) > 450
    joined = "".join(CORPUS)
    for must in ["<|im_start|>", "\u200d", "\t", "漢", "م", "é", "  ", "0123"]:
        assert must in joined


def test_encode_matches_reference(tok: Tokenizer, hf) -> None:
    pairs = [(s, tok.encode(s), hf.encode(s)) for s in CORPUS]
    assert not _mismatches(pairs), _mismatches(pairs)
    pairs = [(s, tok.encode(s, add_special_tokens=False), hf.encode(s, add_special_tokens=False)) for s in CORPUS]
    assert not _mismatches(pairs), _mismatches(pairs)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_reference(tok: Tokenizer, hf, skip: bool) -> None:
    pairs = []
    for s in CORPUS:
        ids = hf.encode(s)
        pairs.append((s, tok.decode(ids, skip_special_tokens=skip), hf.decode(ids, skip_special_tokens=skip)))
    assert not _mismatches(pairs), _mismatches(pairs)
    if not skip:  # byte-level BPE round-trips exactly when specials are kept
        assert all(tok.decode(tok.encode(s), skip_special_tokens=False) == s for s in CORPUS)


def test_special_tokens_match_reference(tok: Tokenizer, hf) -> None:
    assert (tok.bos_token, tok.bos_token_id) == (hf.bos_token, hf.bos_token_id)
    assert (tok.eos_token, tok.eos_token_id) == (hf.eos_token, hf.eos_token_id)
    assert tok.pad_token_id == hf.pad_token_id
    assert tok.vocab_size == len(hf)
    assert tok.chat_template == hf.chat_template
    assert tok.add_bos is False  # SmolLM2's GGUF says add_bos_token = false
    assert tok.encode("<|im_start|>user") == [tok.bos_token_id] + tok.encode("user")


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> tuple[list[str], str, str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    return deltas, tail, detok.text


@pytest.mark.parametrize("prompt_text", ["", "<|im_start|>assistant\nSure: é"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_matches_decode(tok: Tokenizer, prompt_text: str, skip: bool) -> None:
    prompt = tok.encode(prompt_text)
    split_chars = 0
    for s in CORPUS:
        ids = tok.encode(s)
        deltas, tail, text = _stream(tok, prompt, ids, skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected, (s, deltas)
        assert tail == "" and text == expected
        assert "\ufffd" not in text, (s, deltas)
        split_chars += any("\ufffd" in tok.decode([i]) for i in ids)
    assert split_chars > 50  # the corpus really splits characters across tokens


def test_incremental_detokenizer_holds_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("👍")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["👍"]
    truncated = IncrementalDetokenizer(tok, [])
    assert truncated.add(ids[0]) == ""
    assert truncated.flush() == tok.decode(ids[:1])  # end of stream: the dangling bytes are shown


def test_incremental_detokenizer_keeps_prefix_spaces(tok: Tokenizer) -> None:
    prompt = tok.encode("Say:")
    ids = tok.encode(" hello  world")
    deltas, _, text = _stream(tok, prompt, ids, True)
    assert text == " hello  world" and deltas[0] == " hello"


def test_hf_dir_roundtrip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": {"content": tok.bos_token}, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
           "chat_template": tok.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    other = Tokenizer.load(tmp_path)
    assert (other.bos_token_id, other.eos_token_id, other.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert other.vocab_size == tok.vocab_size and other.add_bos is False
    assert all(other.encode(s) == tok.encode(s) for s in CORPUS[:100])
    msgs = [{"role": "user", "content": "hi"}]
    assert other.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **kv: object) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_model_names_field(tmp_path: Path) -> None:
    """A model we cannot build ("t5": SentencePiece Unigram) is refused naming the key and
    what is supported ("llama" is tests/engine/test_tokenizer_spm.py)."""
    path = _write_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "a"], [3, 1])
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 't5'.*supported are 'gpt2' .*and 'llama' "):
        Tokenizer.load(path)


def test_gguf_add_bos_is_honoured(tmp_path: Path) -> None:
    tokens = ["<s>", "h", "i", "hi"]
    path = _write_gguf(tmp_path / "bos.gguf", "gpt2", tokens, [3, 1, 1, 1], token_merges=["h i"],
                       bos_token_id=0, eos_token_id=0, add_bos_token=True)
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos and tok.bos_token == "<s>"
    assert tok.encode("hi") == [0, 3]
    assert tok.encode("hi", add_special_tokens=False) == [3]
    assert tok.decode([0, 3]) == "hi" and tok.decode([0, 3], skip_special_tokens=False) == "<s>hi"


def test_bad_paths_give_clear_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.load(missing)
    with pytest.raises(ValueError, match="without tokenizer.json"):
        Tokenizer.load(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt"):
        Tokenizer.load(text)


def test_incremental_detokenizer_prompt_ending_mid_character(tok: Tokenizer) -> None:
    ids = tok.encode("👍 ok")
    detok = IncrementalDetokenizer(tok, ids[:1])  # the prompt holds only the emoji's first bytes
    deltas = [detok.add(i) for i in ids[1:]]
    assert "".join(deltas) == "👍 ok" and "\ufffd" not in detok.text


def test_open_gguf_reads_what_gguf_reads(model_path) -> None:
    """core.gguf_file parses the file over a plain ndarray view of gguf's memmap (3.8 s
    -> 1 s for the embedded model's vocabulary): every field and tensor is the same."""
    import numpy as np
    from gguf import GGUFReader

    from core.gguf_file import open_gguf

    ours, theirs = open_gguf(model_path), GGUFReader(model_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
