"""What one request may ask for: the bounds both the router (at the HTTP edge) and
every engine (for callers that reach a worker directly) enforce, and the one prompt
check they share. Torch-free, so the router can import it.

Each bound keeps a per-token cost bounded for everyone sharing the batch: stop
strings are matched on the engine thread and on the router's event loop after
every token, so their count and length are capped.
"""
from __future__ import annotations

from typing import Sequence

from core.errors import FieldError

PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1
"""Priorities travel as int32 (lower = more important)."""
MAX_TOP_K = 2**31 - 1
"""top_k travels as uint32; any value at or above the vocabulary means every token."""
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
"""Most logit_bias entries one request may carry (each is applied to its row every step)."""
MAX_BAD_WORDS = 256
MAX_BAD_WORD_TOKENS = 64
"""bad_words: at most this many words, each at most this many tokens (each checked
against the output's tail every step)."""
MAX_GUIDED_CHARS = 200_000
"""Longest output constraint (schema, regex, choices, grammar) a request may carry: it
is compiled on the router and on every worker the request touches."""
MAX_CACHE_SALT_CHARS = 256
"""Longest cache_salt a client may send (it is hashed at the router, whatever its
length; the bound keeps a body's fields sane)."""
MAX_BATCH_PROMPTS = 256
"""Most prompts one /v1/completions request may carry (each is a request of its own
through admission and the workers)."""
MAX_CHOICES = 16
"""Most sequences one request may fork (n, and best_of): each holds its own blocks for
its new tokens and a seat in the batch, so the limit bounds what one request takes."""

MAX_TOOLS = 128
"""Most tools one chat request may offer (their schemas become one grammar)."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as 0 (greedy), as vLLM does: dividing logits
by a subnormal temperature gives inf/NaN, and the limit of sampling is the argmax."""


def check_priority(priority: object, field: str = "priority") -> int:
    """FieldError naming the field unless priority is an int32."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise FieldError(field, f"{field} must be an integer, got {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise FieldError(field, f"{field} must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                                f"got {priority}")
    return priority


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int,
                 output_ids: Sequence[int] = (), max_tokens: int | None = None,
                 limit: str = "the context window (max_model_len)") -> None:
    """FieldError naming the field (prompt, output_token_ids, max_tokens) unless the
    prompt can be served: non-empty, every id in the vocabulary, room for output in
    the context window (and for max_tokens of it, when given). ``limit`` names what
    max_model_len is (a bounded KV policy's total length is another flag's)."""
    if not prompt_ids:
        raise FieldError("prompt", "prompt is empty")
    n = len(prompt_ids) + len(output_ids)
    if n >= max_model_len:  # before reading the ids: an oversized prompt costs nothing
        raise FieldError("prompt", f"prompt has {n} tokens; {limit} "
                                   f"is {max_model_len}, which leaves no room for output")
    for name, seq in (("prompt", prompt_ids), ("output_token_ids", output_ids)):
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise FieldError(name, f"{name}: token id {t!r} is outside the vocabulary "
                                       f"[0, {vocab_size})")
    if max_tokens is not None and len(prompt_ids) + max_tokens > max_model_len:
        raise FieldError("max_tokens", f"max_tokens {max_tokens} + {len(prompt_ids)} prompt "
                                       f"tokens exceed {limit}, {max_model_len}")
