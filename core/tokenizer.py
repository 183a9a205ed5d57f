"""Text <-> token ids for the engine, built from a GGUF file or a Hugging Face directory.

A GGUF carries no tokenizer.json, only llama.cpp's metadata (vocabulary,
merges or scores, token types, special ids). We rebuild a ``tokenizers`` pipeline from it
(core/gguf_vocab.py) that matches llama.cpp's (and, for byte-level BPE, transformers') for
the same file, so prompts tokenize identically whether a model is served from GGUF or
from safetensors.
Streaming needs text per token, which is what ``IncrementalDetokenizer`` does.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from core.chat_template import render_chat_template
from core.gguf_vocab import BUILDERS, SUPPORTED

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

def _gguf_fields(source: Any) -> dict[str, Any]:
    """The tokenizer.* metadata of a GGUF as plain Python values."""
    import gguf

    from core.gguf_file import open_gguf

    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """Post-processor adding BOS/EOS, so `add_special_tokens` controls them like in transformers."""
    pre, post = [bos[0]] if bos else [], [eos[0]] if eos else []
    return processors.TemplateProcessing(single=[*pre, "$A", *post], pair=[*pre, "$A", *post, *pre, "$B", *post],
                                         special_tokens=[s for s in (bos, eos) if s is not None])


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores tokens as strings or as AddedToken dicts."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts and chat template serving needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        probe = backend.encode("", add_special_tokens=True).ids
        # What the pipeline does, not what a flag claims: the post-processor decides.
        self.add_bos: bool = bool(probe) and probe[0] == self.bos_token_id

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token's text can hold (its vocabulary entry's length
        bounds it), so a text of n characters takes at least n / this many tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """Build from a GGUF path or an open ``gguf.GGUFReader``."""
        meta = _gguf_fields(source)
        kind = meta.get("tokenizer.ggml.model")
        if kind not in BUILDERS:
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} in GGUF metadata: supported are {SUPPORTED}")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        backend = BUILDERS[kind](meta)

        def token(key: str) -> str | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        # llama.cpp's default when the key is absent: a BOS for SentencePiece, none for gpt2.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            backend.post_processor = _bos_eos_processor(
                (bos, backend.token_to_id(bos)) if add_bos else None,
                (eos, backend.token_to_id(eos)) if add_eos else None,
            )
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=token("padding_token_id"),
                   unk_token=token("unknown_token_id"), chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json + tokenizer_config.json)."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        backend = tokenizers.Tokenizer.from_file(os.fspath(tok_file))
        cfg_file = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"  # newer transformers save it separately
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        names = {k: _token_content(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if cfg.get("add_bos_token") and names["bos_token"] is not None:
            bos = names["bos_token"]
            probe = backend.encode("", add_special_tokens=True).ids
            if not probe or probe[0] != backend.token_to_id(bos):
                backend.post_processor = _bos_eos_processor((bos, backend.token_to_id(bos)), None)
        return cls(backend, chat_template=template, **names)

    @classmethod
    def load(cls, model_path: str | os.PathLike[str]) -> Tokenizer:
        """A .gguf file or a Hugging Face directory, chosen by what ``model_path`` is."""
        p = Path(model_path)
        if not p.exists():
            raise FileNotFoundError(f"tokenizer source not found: {p}")
        if p.is_dir():
            if (p / "tokenizer.json").is_file():
                return cls.from_hf_dir(p)
            raise ValueError(f"{p} is a directory without tokenizer.json")
        if p.suffix.lower() == ".gguf":
            return cls.from_gguf(p)
        with p.open("rb") as f:
            if f.read(4) == b"GGUF":
                return cls.from_gguf(p)
        raise ValueError(f"{p} is neither a .gguf file nor a Hugging Face model directory")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS/EOS are added only when the model asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the model's chat template; with ``tokenize`` return ids (no extra BOS:
        the template writes its own special tokens, as in transformers)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template")
        specials = {"unk_token": self.unk_token, "pad_token": self.pad_token}
        extra = {k: v for k, v in specials.items() if v is not None}
        extra.update(kwargs)
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token, **extra
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Turn a token stream into text deltas that concatenate to ``decode(output_ids)``.

    Decoding one token alone is wrong twice over: byte-level tokens can hold part
    of a UTF-8 character, and some decoders drop a leading space at the start of
    a sequence. So each step decodes a short window — tokens already emitted
    (``prefix``) plus the new ones (``read``) — and emits the difference, holding
    text back while it ends in an incomplete character (U+FFFD).
    """

    _WINDOW = 5  # prompt tokens used as left context
    _TRIM_AT = 1024  # drop ids before the window once this many accumulate

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids[-self._WINDOW:]]
        self._prefix, self._read = 0, len(self._ids)
        self._chunks: list[str] = []  # joined lazily by `text`, keeping add() O(1)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return only the text it finalised (often "", never a half character)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """At end of stream, emit held-back text as is (an unfinished character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token
        if full.endswith("\ufffd") and not final:
            return ""  # incomplete UTF-8 sequence: wait for the rest
        if full.startswith(prefix_text):
            start = len(prefix_text)
        else:  # only when the prompt itself ended mid-character
            start = len(os.path.commonprefix([prefix_text, full]))
        delta = full[start:]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= self._TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
