"""Grammars for one tokenizer: built from a request's GuidedSpec, compiled once per
distinct constraint (keyed by its content hash, least recently used dropped), and
copied for each request that uses it. Torch-free: the router compiles and checks a
request's constraint at the HTTP edge and every worker does it again before it
queues the request.

llguidance is the engine (per-token masks in tens of microseconds, grammars in
milliseconds, JSON Schema, regex, Lark and GBNF in one library). Its tokenizer is
built from ours (the ``tokenizers`` pipeline serialised), so the two agree on every
token's bytes.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance

from core.errors import FieldError
from core.guided.acceptor import GrammarAcceptor
from core.guided.budget import (COMPILE_SECONDS, SEARCH_SECONDS, TOO_DEEP, Deadline, check_depth,
                                parser_limits)
from core.guided.probe import probe
from core.guided.search import byte_tokenizer, fewest_tokens, shortest_output
from core.guided.spec import GuidedSpec
from core.tokenizer import Tokenizer

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How generated JSON is laid out: one space after ',' and ':', no other whitespace
(a schema's "x-guidance" object overrides it). Free whitespace lets a small model
pad an object with newlines until max_tokens runs out."""
MAX_ERROR_CHARS = 400


@dataclass
class _Compiled:
    grammar: str
    matcher: llguidance.LLMatcher
    """Pristine: never advanced, only copied."""
    min_tokens: int | None = None
    searched: bool = False


@dataclass
class GuidedState:
    """One request's position in its grammar. Advanced by the engine thread only
    (SamplingState.append); the mask thread reads it while a step's forward runs."""

    spec: GuidedSpec
    matcher: llguidance.LLMatcher
    error: str = ""
    """Set once a token the grammar refuses was consumed; the request then fails."""

    def consume(self, token_id: int) -> bool:
        if not self.error and not self.matcher.consume_token(int(token_id)):
            self.error = _short(self.matcher.get_error() or f"token {token_id} refused")
        return not self.error

    @property
    def stopped(self) -> bool:
        """The output is complete: the grammar allows nothing more (not even EOS is needed)."""
        return not self.error and self.matcher.is_stopped()


def _short(message: str) -> str:
    message = message.split("\n<state>")[0].strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


def _json(text: str, what: str) -> object:
    """The parsed text, nested at most MAX_JSON_DEPTH deep; ValueError otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not {what}: {e}") from None
    check_depth(value)
    return value


def _choices(text: str) -> str:
    choices = _json(text, "a JSON list of strings")
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise ValueError("must be a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def check_schema(schema: object) -> None:
    """ValueError saying where a JSON Schema breaks its metaschema, or that it nests
    deeper than MAX_JSON_DEPTH (checked first: the metaschema check recurses)."""
    import jsonschema  # names what is wrong with a schema better than the compiler does

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"must be a JSON object, got {type(schema).__name__}")
    check_depth(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"is not a valid JSON Schema at {where}: {e.message}") from None
    except RecursionError:  # (called from deep in a stack: the depth check was not enough)
        raise ValueError(TOO_DEEP) from None


def _schema(text: str) -> str:
    schema = _json(text, "valid JSON")
    check_schema(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def grammar_of(spec: GuidedSpec) -> str:
    """The llguidance grammar for a spec. ValueError saying what is wrong with it."""
    try:
        return _grammar_of(spec)
    except RecursionError:  # a JSON text nested past what the parser can take
        raise ValueError(TOO_DEEP) from None


def _grammar_of(spec: GuidedSpec) -> str:
    if spec.kind == "json_schema":
        return _schema(spec.text)
    if spec.kind == "regex":  # \d is [0-9], as a client writing a phone number means it
        return llguidance.LLMatcher.grammar_from_lark(
            f"start: /{llguidance.regex_to_lark(spec.text, 'd')}/")
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choices(spec.text))
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.text)
    return spec.text  # llguidance: already in the library's own format


@dataclass
class GrammarCompiler:
    """Thread-safe. The llguidance tokenizer is built on first use (about 0.5 s for a
    50k vocabulary), so a process that never sees a constraint never pays for it."""

    tokenizer: Tokenizer
    vocab_size: int | None = None
    """Width of the model's logits (the masks'), when it differs from the tokenizer's."""
    eos_token_ids: Sequence[int] = ()
    cache_size: int = 256
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _ll: llguidance.LLTokenizer | None = field(default=None, repr=False)
    _bytes: tuple | None = field(default=None, repr=False)
    _byte_ll: llguidance.LLTokenizer | None = field(default=None, repr=False)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = list(self.eos_token_ids) or self.tokenizer.eos_token_id
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._ll

    def _compiled(self, spec: GuidedSpec) -> _Compiled:
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = grammar_of(spec)
        error = probe().check(grammar, COMPILE_SECONDS)  # OverBudget past the budget
        if error:
            raise ValueError(_short(error))
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                       limits=parser_limits())
        if matcher.is_error():
            raise ValueError(_short(matcher.get_error()))
        compiled = _Compiled(grammar, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, spec: GuidedSpec) -> GuidedState:
        """A fresh state for one request. ValueError when the grammar cannot compile."""
        compiled = self._compiled(spec)
        with self._lock:
            return GuidedState(spec, compiled.matcher.deep_copy())

    def min_tokens(self, spec: GuidedSpec) -> int | None:
        """Tokens in the shortest complete output (EOS counted when the grammar needs
        one to end; at least that many when counting them ran out of time), or None
        when the search gave up (core/guided/search.py)."""
        compiled = self._compiled(spec)
        if not compiled.searched:
            compiled.min_tokens = self._search(compiled.grammar)
            compiled.searched = True
        return compiled.min_tokens

    def _search(self, grammar: str) -> int | None:
        deadline = Deadline(SEARCH_SECONDS)
        token_bytes, longest = self._vocab_bytes()
        start = llguidance.LLMatcher(self._byte_ll, grammar, log_level=0, limits=parser_limits())
        if start.is_error():  # (a grammar naming special tokens: no check)
            return None
        found = shortest_output(start, deadline)
        if found is None:
            return None
        data, stopped = found
        return fewest_tokens(data, token_bytes, longest, deadline) + (not stopped)

    def check(self, spec: GuidedSpec, max_tokens: int, field: str = "guided",
              schemas: Sequence[tuple[str, object]] = ()) -> None:
        """The whole check of one request's constraint, within the budgets of
        core/guided/budget.py: each of ``schemas`` ((its field, a JSON Schema), e.g. a
        tool's parameters) is a valid schema, the grammar compiles, and a complete
        output fits in max_tokens. FieldError naming the field (or max_tokens). Up to
        about COMPILE_SECONDS + SEARCH_SECONDS of CPU: call it off any event loop."""
        for name, schema in schemas:
            try:
                check_schema(schema)
            except ValueError as e:
                raise FieldError(name, f"{name}: {e}") from None
        try:
            self._compiled(spec)
        except ValueError as e:
            raise FieldError(field, f"{field}: {e}") from None
        need = self.min_tokens(spec)
        if need is not None and need > max_tokens:
            raise FieldError("max_tokens", f"max_tokens: {max_tokens} is too few for {field}: "
                                           f"its shortest complete output takes {need} tokens")

    def accepts(self, spec: GuidedSpec, text: str) -> bool:
        """Whether ``text`` is a complete output of the grammar."""
        return self._acceptor(self.start(spec).matcher).accepts(text)

    def acceptor(self, spec: GuidedSpec | None, stop: Sequence[str],
                 state: GuidedState | None = None) -> GrammarAcceptor | None:
        """For the stop-string matcher of a constrained request: a stop string ends the
        output only where the text before it is complete; inside the structure it is
        just text. state: the request's grammar state where its text starts (after
        outputs made elsewhere); a fresh one by default. None when there is nothing
        to decide."""
        if spec is None or not stop:
            return None
        matcher = state.matcher.deep_copy() if state is not None else self.start(spec).matcher
        return self._acceptor(matcher)

    def _acceptor(self, matcher: llguidance.LLMatcher) -> GrammarAcceptor:
        ll = self.ll_tokenizer
        return GrammarAcceptor(matcher, ll.tokenize_bytes)

    def _vocab_bytes(self) -> tuple[frozenset[bytes], int]:
        """Every plain token's bytes and the longest; the byte tokenizer built too."""
        ll = self.ll_tokenizer
        with self._lock:
            if self._bytes is None:
                plain = [ll.decode_bytes([t]) for t in range(ll.vocab_size)
                         if not ll.is_special_token(t)]
                plain = [d for d in plain if d]
                self._bytes = (frozenset(plain), max(map(len, plain)))
                self._byte_ll = byte_tokenizer()
            return self._bytes
