"""Per-request sampling parameters (OpenAI / vLLM semantics).

Validated once at the API boundary so the sampler's hot path can trust every
value; a bad value raises FieldError (a ValueError) naming the field and its allowed
range.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from core.errors import FieldError
from core.guided.spec import GuidedSpec
from core.limits import (GREEDY_TEMPERATURE, MAX_BAD_WORD_TOKENS, MAX_CHOICES, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                         MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_K)

MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for (OpenAI's limit)."""

MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS_VALUE = 100.0
"""OpenAI's bound on a logit_bias value (either sign)."""


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(name, f"{name} must be {rng}, got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise FieldError(name, f"{name} must be a number, got {value!r}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise FieldError(name, f"{name} must be in {rng}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    """Most tokens to generate (>= 0; 0: the request ends after its prompt with no
    token, its prompt logprobs, when asked, being all it returns)."""
    temperature: float = 1.0
    """Softmax temperature in [0, 2]; 0 (and anything below 1e-5) means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    repetition_penalty: float = 1.0
    """HF/vLLM: over prompt+output tokens, divide positive logits and multiply negative ones; (0, 2]."""
    presence_penalty: float = 0.0
    """OpenAI: subtract this once from each token already in the output; [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this times the token's count in the output; [-2, 2]."""
    seed: int | None = None
    """Per-request seed making the draws independent of batch mates; None uses the shared RNG."""
    stop: tuple[str, ...] = ()
    """Stop strings (at most 32, each at most 256 characters); the output is cut right
    before (or after, see below) the first one hit."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (in addition to EOS); at most 256."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """None: no logprobs; N in [0, 20]: the chosen token's logprob plus the top N."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output."""
    guided: GuidedSpec | None = None
    """What the output must match (JSON Schema, regex, choice, grammar); None: free text.
    The grammar decides where the output ends: EOS is allowed only where it is complete,
    and ignore_eos does not apply."""
    speculate: bool = True
    """False: this request opts out of speculative decoding (when the engine speculates)."""
    min_tokens: int = 0
    """vLLM: fewest tokens to generate before EOS, a stop token id or a stop string may end
    the output (EOS and the stop ids are masked until then; stop strings are looked for
    only in the text after the first min_tokens tokens); at most max_tokens."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI: (token id, bias) pairs added to the logits before sampling, each bias in
    [-100, 100] (-100 bans the token in practice, 100 all but forces it). A dict is
    accepted and stored as sorted pairs."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM: only these tokens may be sampled (non-empty); None: every token."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """vLLM's bad_words as the tokenizer spells them: the last token of a sequence is banned
    wherever the output ends with the tokens before it (a one-token word: everywhere)."""
    skip_special_tokens: bool = True
    """vLLM: leave special tokens out of the output text (and the stop-string search)."""
    prompt_logprobs: int | None = None
    """vLLM: None: none; N in [0, 20]: each prompt token's logprob after the first (the
    model's distribution at the position before it) plus the top N there, computed
    during prefill (OpenAI's echo with logprobs asks for them too)."""
    n: int = 1
    """Sequences to generate from the prompt, in [1, MAX_CHOICES]: one prefill, then the
    engine forks the prompt's blocks copy-on-write (engine/fork.py); choice j draws from
    its own stream (``choice_seed``)."""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 0)
        _check_int("n", self.n, 1, MAX_CHOICES)
        if self.n > 1 and self.max_tokens == 0:  # nothing to fork: the choices would be one
            raise FieldError("n", "n must be 1 when max_tokens is 0 (a prompt-only request)")
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_int("top_k", self.top_k, 0, MAX_TOP_K)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._normalise_stops()
        self._normalise_token_rules()
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise FieldError("guided", f"guided must be a GuidedSpec, "
                                       f"got {type(self.guided).__name__}")

    def _normalise_stops(self) -> None:
        """Accept lists (JSON) and a bare string, store tuples so the object stays hashable."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop: at most {MAX_STOP_STRINGS} stop strings, "
                                     f"got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"stop must contain non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise FieldError("stop", f"stop: each stop string may have at most "
                                         f"{MAX_STOP_STRING_CHARS} characters, got one of {len(s)}")
        ids = tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, "
                                               f"got {len(ids)}")
        for t in ids:
            _check_int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)

    def _normalise_token_rules(self) -> None:
        """Check min_tokens, logit_bias, allowed_token_ids and bad words; store tuples."""
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        bias = self.logit_bias
        pairs = tuple(sorted(dict(bias).items()))  # a mapping or pairs; one entry per id
        if len(pairs) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} entries, "
                                           f"got {len(pairs)}")
        for t, v in pairs:
            _check_int("logit_bias", t, 0)
            _check_float("logit_bias", v, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in pairs))
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed:
                raise FieldError("allowed_token_ids", "allowed_token_ids must not be empty "
                                                      "(leave it out to allow every token)")
            for t in allowed:
                _check_int("allowed_token_ids", t, 0)
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(tuple(w) for w in self.bad_words_token_ids)
        if len(words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS
                                             for w in words):
            raise FieldError("bad_words", f"bad_words: at most {MAX_BAD_WORDS} words of 1 to "
                                          f"{MAX_BAD_WORD_TOKENS} tokens each")
        for w in words:
            for t in w:
                _check_int("bad_words", t, 0)
        object.__setattr__(self, "bad_words_token_ids", words)

    def check_vocab(self, vocab_size: int) -> None:
        """FieldError naming the field when a token id the request names (logit_bias,
        allowed_token_ids, bad words) is outside the vocabulary [0, vocab_size)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for w in self.bad_words_token_ids for t in w])):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise FieldError(name, f"{name}: token id {bad} is outside the vocabulary "
                                       f"[0, {vocab_size})")

    @property
    def has_token_rules(self) -> bool:
        """True when the sampler must mask or bias this row (logit_bias, allowed tokens,
        bad words, min_tokens)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_token_ids or self.min_tokens)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature below 1e-5): no RNG is consumed."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        """True when any penalty changes the logits, so the sampler must count tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed under a request's seed: choice 0 keeps the seed itself (so
    it equals the same request with n = 1), each other choice gets its own stream."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"tandem-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED
