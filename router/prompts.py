"""Prompt-side request fields that need the tokenizer: vLLM's truncate_prompt_tokens
and bad_words. Torch-free; the router runs them on its parsing pool."""
from __future__ import annotations

from collections.abc import Sequence

from core.errors import FieldError
from core.tokenizer import Tokenizer


def truncated(ids: list[int], keep: int | None, most: int, max_tokens: int | None,
              what: str = "the context window (max_model_len)") -> list[int]:
    """The prompt's last ``keep`` tokens (vLLM truncates on the left); -1: as many as
    ``most`` (the request's length limit, ``what``: the context window, or
    --max-stream-len under a bounded kv_policy) holds with room for max_tokens (or one
    token); None: all."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max(1, most - (max_tokens or 1))
    if not 1 <= keep <= most:
        raise FieldError("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or in "
                                                   f"[1, {most}] ({what}), got {keep}")
    return ids[-keep:]


def bad_words_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written (leading spaces
    stripped), and with one leading space when that spells it with other tokens of
    the same count (the word inside a sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise FieldError("bad_words", f"bad_words: {word!r} has no tokens")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)
