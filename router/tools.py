"""Tool calling at the OpenAI edge: what the model is told, what it may write, and
how its output becomes ``message.tool_calls``.

The calls are written in the form the model's chat template teaches
(router/tool_formats.py: Qwen's ``<tool_call>`` blocks, Llama 3's JSON object, else
``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``, SmolLM2's) and
constrained by a grammar built from the tools' parameter schemas:

- ``required``: one or more calls of the offered tools (one when
  parallel_tool_calls is false); a named tool_choice: exactly one call of it;
- ``auto``: either plain text (which then may not begin with the calls' first
  character, "<" or "{") or calls;
- ``none``: no constraint, and the tools are not shown to the model.

How tools reach the model: a chat template that uses ``tools`` gets them (and
assistant turns' tool_calls) as transformers passes them; for one that does not
(SmolLM2's), a system block lists them as JSON and says how to call, and earlier
calls are written back in the same ``<tool_call>`` form. Role "tool" messages go
through the template as they are.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from core.errors import FieldError
from core.guided.compiler import JSON_STYLE
from core.guided.spec import GuidedSpec
from router.tool_formats import ARRAY, ToolFormat

TOOL_OPEN, TOOL_CLOSE = ARRAY.open, ARRAY.close
SYSTEM_BLOCK = (
    "You may call functions. The functions you can call, as JSON Schemas:\n<tools>\n{tools}\n"
    "</tools>\nTo call functions, answer with only " + TOOL_OPEN + '[{{"name": <function name>, '
    '"arguments": <arguments object>}}]' + TOOL_CLOSE + "; otherwise answer in plain text.")


@dataclass(frozen=True)
class ToolPlan:
    """How one request may use its tools."""

    mode: str
    """auto | required | named"""
    functions: tuple[dict[str, Any], ...]
    """The OpenAI function definitions the model may call (name, description, parameters)."""
    parallel: bool = True
    format: ToolFormat = ARRAY
    """How the model writes calls (its chat template's form)."""

    def spec(self, text: GuidedSpec | None = None) -> GuidedSpec:
        """The grammar of the output. text: what plain text must match under auto (a
        JSON response_format), None for free text."""
        calls = self.format.rules(self.functions, self.parallel)
        if self.mode != "auto":
            return GuidedSpec("grammar", "start: calls\n" + calls)
        if text is None:
            lead = re.escape(self.format.lead)
            lark = f'start: TEXT | calls | ""\nTEXT: /[^{lead}](.|\\n)*/\n'
        else:
            lark = f"start: text | calls\ntext: %json {_styled(json.loads(text.text))}\n"
        return GuidedSpec("grammar", lark + calls)

    def parse(self, text: str) -> list[dict] | None:
        """OpenAI tool_calls from a complete output, or None when it holds no calls."""
        return self.format.parse(text)

    def system_block(self) -> str:
        return SYSTEM_BLOCK.format(tools=json.dumps(list(self.functions), indent=1))


def _styled(schema: dict) -> str:
    """A schema laid out like every other generated JSON (compiler.JSON_STYLE)."""
    return json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})



def template_messages(messages: list[dict], plan: ToolPlan | None, template: str | None
                      ) -> tuple[list[dict], dict[str, Any]]:
    """Messages ready for the chat template, and extra template variables (tools)."""
    msgs = [_plain(m) for m in messages]
    if template is not None and "tools" in template:  # the template renders tools itself
        tools = [{"type": "function", "function": f} for f in plan.functions] if plan else None
        return msgs, ({"tools": tools} if tools else {})
    msgs = [_inline_calls(m) for m in msgs]
    if plan is not None:
        block = plan.system_block()
        if msgs and msgs[0].get("role") == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0].get('content') or ''}\n\n{block}"}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    return msgs, {}


def _plain(message: dict) -> dict:
    """Text parts joined into one string; tool call arguments as objects (transformers'
    convention for templates)."""
    m = dict(message)
    if isinstance(m.get("content"), list):
        parts = m["content"]
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
            raise FieldError("messages", "messages: only text content parts are supported")
        m["content"] = "".join(str(p.get("text", "")) for p in parts)
    if m.get("tool_calls"):
        m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
    return m


def _call_for_template(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass  # left as the text it is
    return {**call, "function": fn}


def _inline_calls(message: dict) -> dict:
    """An assistant turn's tool_calls written into its content, as the model writes them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    body = [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
            for c in calls]
    m = {k: v for k, v in message.items() if k != "tool_calls"}
    m["content"] = (m.get("content") or "") + ARRAY.write(body)
    return m


def parse_calls(text: str) -> list[dict] | None:
    """OpenAI tool_calls from a complete output in the fallback (array) form."""
    return ARRAY.parse(text)


class ToolCallText:
    """A tool-capable response's text as it streams: what may go out as content now,
    and at the end the calls. Under auto the first character decides (calls begin
    with the format's lead, plain text may not; a JSON text under Llama 3's format
    shares its "{" and is held to the end); otherwise everything is held for the calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._content: bool | None = None if plan.mode == "auto" else False
        self._held: list[str] = []

    def feed(self, text: str) -> str:
        if self._content is None and text:
            self._content = not text.startswith(self._plan.format.lead)
        if self._content:
            out, self._held = "".join(self._held) + text, []
            return out
        self._held.append(text)
        return ""

    def finish(self, reason: str | None) -> tuple[str, list[dict] | None]:
        """(content still owed, the calls or None); calls only from a complete output."""
        text, self._held = "".join(self._held), []
        calls = self._plan.parse(text) if reason == "stop" and not self._content else None
        return ("" if calls else text), calls
