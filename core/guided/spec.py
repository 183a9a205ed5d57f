"""What one request's output must match: a kind and its text, as the OpenAI edge
(response_format, tools, vLLM's guided_*) or a worker's caller gives it. Torch-free
and llguidance-free: SamplingParams carries it, the proto carries it, and every side
builds the same grammar from it (core/guided/compiler.py)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from core.errors import FieldError
from core.limits import MAX_GUIDED_CHARS

KINDS = ("json_schema", "regex", "choice", "grammar", "llguidance")
"""json_schema: a JSON Schema as JSON text; regex: a Rust-regex the whole output must
match; choice: a JSON list of strings, the output is one of them; grammar: Lark (as
llguidance takes it) or GBNF; llguidance: a grammar in llguidance's own JSON format
(what the router builds for tool calls)."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""response_format {"type": "json_object"}: any JSON object."""


@dataclass(frozen=True)
class GuidedSpec:
    kind: str
    """One of KINDS."""
    text: str
    """The schema, regex, choices or grammar, as text."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FieldError("guided.kind", f"guided.kind must be one of {', '.join(KINDS)}, "
                                            f"got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text:
            raise FieldError("guided.text",
                             f"guided.text must be a non-empty string ({self.kind})")
        if len(self.text) > MAX_GUIDED_CHARS:
            raise FieldError("guided.text", f"guided.text: at most {MAX_GUIDED_CHARS} "
                                            f"characters, got {len(self.text)} ({self.kind})")

    @property
    def key(self) -> str:
        """Content hash: equal constraints share one compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict | str) -> GuidedSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedSpec:
        return cls("choice", json.dumps(list(choices)))
