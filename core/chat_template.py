"""Render a model's Jinja chat template the way Hugging Face transformers does.

Prompts must be byte-identical to what the model was fine-tuned on, and model
authors test their templates against transformers, so we reproduce its jinja
environment: sandboxed, ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` tag, and the ``raise_exception``,
``tojson``, ``strftime_now``, ``dict`` and ``namespace`` helpers. Templates are
untrusted text from model files, hence the immutable sandbox.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "validate_messages"]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    Templates written for assistant-token masks use this tag; without the
    extension they would not even compile. We never need the masks.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates without exposing the real type object."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A jinja ``namespace`` that refuses underscore names (sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's builtin tojson HTML-escapes ("<" -> "\u003c"); templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template: compiling costs ~ms, rendering ~µs."""
    return _environment().from_string(template)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the chat shape and return plain copies with None-valued keys dropped.

    Dropping None mirrors transformers: OpenAI-style clients send
    ``content=None`` or ``tool_calls=None`` and templates handle a missing key
    but would render a literal "None".
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" not in msg:
            raise ValueError(f"messages[{i}].content is missing")
        content = msg["content"]
        if content is None and not msg.get("tool_calls"):
            raise ValueError(f"messages[{i}].content is None (allowed only with tool_calls)")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}"
            )
        out.append({k: v for k, v in msg.items() if v is not None})
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template`` exactly as transformers' ``apply_chat_template``.

    ``extra`` reaches the template as variables (``tools``, ``documents``,
    ``unk_token``, ``enable_thinking``, ...); ``tools`` and ``documents``
    default to None as in transformers. Raises ValueError for malformed
    messages and jinja2.TemplateError for template errors (including the
    template's own ``raise_exception`` calls).
    """
    if not isinstance(template, str) or not template:
        raise ValueError("chat template must be a non-empty string")
    chat = validate_messages(messages)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    # Like transformers' special_tokens_map: an unset token is left undefined, not "None".
    variables.update((k, v) for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None)
    variables.update(extra)
    return _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
