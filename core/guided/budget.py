"""What checking one constraint may cost: the size and time budgets of compiling a
grammar and of searching its shortest output (docs/reliability.md lists them, and
what a client sees when one is hit).

A constraint is short to send and may be costly to build: an ``allOf`` of a few
``anyOf``s of string patterns (1.3 KB) takes llguidance about 30 s to compile on our
machines, and no ``LLParserLimits`` field bounds that time (the size checks come
after the work). So compiling is first tried in a child process that is killed at
``COMPILE_SECONDS`` (core/guided/probe.py); the search (Python, engine/guided/
search.py) watches a deadline itself. Threads cannot be killed: whatever runs in
one must stop by itself within its budget.

Torch-free: the router checks every constraint with the same budgets as the workers.
"""
from __future__ import annotations

import time

import llguidance

COMPILE_SECONDS = 2.0
"""Wall-clock budget for building one grammar (llguidance), measured in the probe
process, which is killed when it runs past it; the constraint is then refused. The
schemas of tests/guided_cases.py are checked (built and searched) in under 0.03 s
each here."""
SEARCH_SECONDS = 1.0
"""Budget of the shortest-output search (and of counting its tokens). A search that
runs out gives up: no max_tokens check, the request runs and ends "length" when
max_tokens comes first, as it does without the check."""
SEARCH_NODES = 20_000
"""Most search nodes (each a few llguidance masks over the 256 bytes)."""
SEARCH_MAX_BYTES = 65_536
"""Longest candidate output the search follows: longer ones are not followed (a
grammar whose shortest output is longer gets no max_tokens check)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays in a JSON Schema (or a choice list). The
metaschema check (jsonschema) recurses about twice per level and hits Python's
recursion limit near 130."""
TOO_DEEP = f"nests too deeply; the budget is {MAX_JSON_DEPTH} levels"
"""The error for a text nested past what Python's JSON parser (or recursion) takes."""
PARSER_LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}
"""llguidance's own size limits (its defaults, named here so they are ours): the
grammar's symbols and the lexer's initial fuel bound a build; the per-step fuel and
Earley items bound each mask (each search node, each decoding step); the lexer
states bound a grammar's memory (about 1-2 kB each). A build over one of them fails
with llguidance's message naming the limit and its value."""


class Deadline:
    """A point in time a cooperative loop checks (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar: 0).
    Iterative, so a value nested too deeply for Python's recursion is measured too."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children)
    return deepest


def check_depth(value: object) -> None:
    """ValueError when the value nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nests {depth} levels deep; the budget is {MAX_JSON_DEPTH} levels")
