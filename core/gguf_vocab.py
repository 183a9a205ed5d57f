"""The ``tokenizers`` pipeline a GGUF's vocabulary describes: one builder per
``tokenizer.ggml.model`` (``BUILDERS``), each from llama.cpp's metadata as plain values.

"gpt2" is byte-level BPE with stored merges (Llama 3, Qwen, SmolLM); "llama" is
SentencePiece BPE (Llama 2, Mistral, Mixtral, Phi-3, Gemma), whose merges GGUF does
not store: they follow from the pieces' scores. "gpt2" matches what transformers' GGUF
reader builds for the same file; "llama" matches llama.cpp and sentencepiece itself
(transformers 5's reader does not: it always leads with "▁", and encodes " " as one "▁").
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

__all__ = ["BUILDERS", "build_byte_level_bpe", "build_sentencepiece_bpe"]

# llama.cpp's token types (tokenizer.ggml.token_type); 0 (undefined) and 1 are normal.
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 2, 3, 4, 5, 6
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer regex by `tokenizer.ggml.pre`. Anything else, "smollm" included,
# gets GPT-2's ByteLevel regex: that is what transformers builds for these files,
# and matching it is the contract. (llama.cpp's "smollm" also isolates every digit,
# like SmolLM2's own tokenizer.json; the two differ only around space runs before
# digits, e.g. "a  1" -> [a, Ġ, Ġ, 1] here vs [a, ĠĠ, 1].)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_level_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """BPE + ByteLevel pipeline from llama.cpp "gpt2" metadata, specials as added tokens."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens are stored in the byte alphabet; a few converters wrote raw UTF-8 instead.
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    # A "control" token outside the byte alphabet is a converter mislabel; adding it
    # would grow the vocabulary past the embedding table, so it is skipped.
    tok.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= spelled
    ])
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab
    ])
    return tok


_SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces
_NEVER_MERGED = {_UNKNOWN, _CONTROL, _UNUSED, _BYTE}
"""Types SentencePiece keeps out of its merge table (its reserved pieces; unused ones it
would split back, which a merge table cannot say, so they are never formed here)."""


def _score_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: every split of a piece into two pieces, ranked by the
    merged piece's score, highest first (ties: lower id, then shorter left part)."""
    mergeable = [ty not in _NEVER_MERGED for ty in types] + [True] * (len(tokens) - len(types))
    pieces = {t for t, ok in zip(tokens, mergeable) if ok}
    ranked = []
    for i, (t, ok) in enumerate(zip(tokens, mergeable)):
        if not ok:
            continue
        for cut in range(1, len(t)):
            if t[:cut] in pieces and t[cut:] in pieces:
                ranked.append((-scores[i], i, cut, t[:cut], t[cut:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_sentencepiece_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece BPE from llama.cpp "llama" metadata, as llama.cpp's llm_tokenizer_spm
    encodes: spaces become "▁" (and one leads each text run unless add_space_prefix is
    false), adjacent symbols merge highest score first, and a character no piece holds
    falls back to its UTF-8 bytes' <0xNN> tokens.

    Why ``models.BPE`` with merges derived from the scores, not ``models.Unigram``:
    Unigram picks the segmentation with the best total score (Viterbi), SentencePiece BPE
    greedily merges the best-scoring adjacent pair, and BPE with merges ranked by the
    merged piece's score is that greedy loop (equal-score pairs aside: SentencePiece takes
    the leftmost, BPE the lower rank; scores are distinct for trained pieces). No
    pre-tokenizer: SentencePiece merges across the whole text run, as llama.cpp does.
    """
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError("GGUF metadata has no tokenizer.ggml.scores, which tokenizer.ggml.model "
                         "'llama' (SentencePiece) needs to rank its merges")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = tokenizers.Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=_score_merges(tokens, meta["tokenizer.ggml.scores"], types),
        unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        fuse_unk=True, byte_fallback=True, ignore_merges=False))
    # Normalizers run on each run of text between added tokens, so a run that follows a
    # special token gets its own leading "▁", as in llama.cpp.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(_SPACE)] if prefix else []), normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence([
        decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    # Control and unknown pieces (<s>, </s>, <start_of_turn>, <unk>) are matched in text
    # as special tokens, user-defined ones as plain added tokens, as llama.cpp does.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


BUILDERS: dict[str, Callable[[Mapping[str, Any]], tokenizers.Tokenizer]] = {
    "gpt2": build_byte_level_bpe,
    "llama": build_sentencepiece_bpe,
}
"""tokenizer.ggml.model -> the builder of its pipeline from the tokenizer.* metadata."""
SUPPORTED = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
