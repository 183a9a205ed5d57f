"""How a model writes its tool calls: the form its chat template teaches it, read from
the template's text, as a grammar for the constrained output and a parser back into
OpenAI ``tool_calls``.

- ``hermes`` (Qwen2.5, Qwen3, Hermes, whose templates show ``<tool_call>``): one block
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call, blocks
  separated by a newline, as the template writes earlier calls back;
- ``llama3_json`` (Llama 3.1/3.2, whose templates ask for ``{"name": function name,
  "parameters": ...}``): one bare JSON object, one call (the template shows no way to
  write several);
- ``array``, the fallback for every other template (SmolLM2's, which does not render
  tools, and Mistral's, whose ``[TOOL_CALLS]`` marker is a control token that decoded
  text does not hold): ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from core.guided.compiler import JSON_STYLE

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str
    """What each block of calls begins with ("" for a bare JSON object)."""
    close: str
    array: bool
    """A block holds a JSON array of calls (else one call object)."""
    separator: str | None
    """Between blocks when there are several; None: one block only."""
    arguments_key: str = "arguments"
    """The call object's key for the arguments (Llama 3's templates say "parameters")."""

    @property
    def lead(self) -> str:
        """The first character of any output of calls (under tool_choice auto, plain
        text may not begin with it, so the first character tells the two apart)."""
        return self.open[:1] or ("[" if self.array else "{")

    def rules(self, functions: tuple[dict[str, Any], ...], parallel: bool) -> str:
        """Lark rules defining ``calls``: every output of calls of these functions, at
        most one call when not parallel."""
        items = [{"type": "object", "additionalProperties": False,
                  "required": ["name", self.arguments_key],
                  "properties": {"name": {"const": f["name"]},
                                 self.arguments_key: f.get("parameters") or NO_ARGUMENTS}}
                 for f in functions]
        call = {**(items[0] if len(items) == 1 else {"anyOf": items}), "x-guidance": JSON_STYLE}
        if self.array:
            call = {"type": "array", "minItems": 1, "items": call, "x-guidance": JSON_STYLE}
            if not parallel:
                call["maxItems"] = 1
        block = " ".join([*_literal(self.open), "body", *_literal(self.close)])
        if self.separator is None or not parallel:
            calls = "calls: block\n"
        else:
            calls = f"calls: block ({json.dumps(self.separator)} block)*\n"
        return f"{calls}block: {block}\nbody: %json {json.dumps(call)}\n"

    def parse(self, text: str) -> list[dict] | None:
        """OpenAI tool_calls from a complete output, or None when it is not calls."""
        found = self._calls(text.strip())
        if not found or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                for c in found):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"],
                              "arguments": json.dumps(c.get(self.arguments_key, {}))}}
                for c in found]

    def _calls(self, s: str) -> list | None:
        bodies = [s] if not self.open else None
        if self.open:
            block = re.escape(self.open.strip()) + r"(.*?)" + re.escape(self.close.strip())
            bodies = re.findall(block, s, re.DOTALL)
            if not bodies or re.sub(block, "", s, flags=re.DOTALL).strip():
                return None  # text outside the blocks: not an output of calls
            if len(bodies) > 1 and self.separator is None:
                return None
        calls = []
        for body in bodies:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return None
            if isinstance(value, list) != self.array:
                return None
            calls += value if self.array else [value]
        return calls

    def write(self, calls: list[dict]) -> str:
        """Calls ({"name", "arguments"}) as the model writes them (earlier turns' calls
        written back into a template that does not render tool_calls)."""
        objs = [{"name": c["name"], self.arguments_key: c["arguments"]} for c in calls]
        if self.array:
            return self.open + json.dumps(objs) + self.close
        return (self.separator or "").join(self.open + json.dumps(o) + self.close for o in objs)


def _literal(text: str) -> list[str]:
    return [json.dumps(text)] if text else []


ARRAY = ToolFormat("array", "<tool_call>", "</tool_call>", array=True, separator=None)
HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", array=False, separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", array=False, separator=None,
                         arguments_key="parameters")


def tool_format(template: str | None) -> ToolFormat:
    """The format a chat template teaches (it renders ``tools`` and shows the form);
    ARRAY where it shows none."""
    if template is None or "tools" not in template:
        return ARRAY
    if "<tool_call>" in template:
        return HERMES
    if '"parameters": dictionary of argument name' in template:
        return LLAMA3_JSON
    return ARRAY
