"""One request's output constraint, from whichever OpenAI or vLLM field asked for it.

Accepted (at most one of the first four; tools combine with a JSON one under auto):
- ``response_format``: {"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (OpenAI); {"type": "text"} is none;
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's
  older fields; the grammar is Lark as llguidance takes it, or GBNF);
- ``structured_outputs``: {"json" | "regex" | "choice" | "grammar" | "json_object"}
  (vLLM's newer object, one key);
- ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (router/tools.py).
The constraint is compiled and checked (a complete output must fit in max_tokens)
before the request is queued; every error is a 400 naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from core.guided.compiler import check_schema
from core.guided.spec import JSON_OBJECT_SCHEMA, GuidedSpec
from core.limits import MAX_GUIDED_CHARS
from router.http.errors import APIError
from router.openai_api import NamedToolChoice, ResponseFormat
from router.tool_formats import tool_format
from router.tools import ToolPlan


@dataclass(frozen=True)
class Constraint:
    spec: GuidedSpec | None = None
    field: str = ""
    """The request field the constraint came from (named in its errors)."""
    tools: ToolPlan | None = None
    """Set when the output may hold tool calls."""


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field)


def _spec(field: str, kind: str, text: str) -> GuidedSpec:
    """GuidedSpec(kind, text), or APIError naming the field (empty, too long)."""
    try:
        return GuidedSpec(kind, text)
    except ValueError as e:
        raise _bad(field, str(e)) from None


def _json_spec(field: str, schema: dict | str) -> GuidedSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _bad(field, f"is not valid JSON: {e}") from None
    return _spec(field, "json_schema", json.dumps(schema))


def _response_format(rf: ResponseFormat) -> GuidedSpec | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema.schema_ is None:
        return GuidedSpec("json_schema", JSON_OBJECT_SCHEMA)
    return _json_spec("response_format", rf.json_schema.schema_)


def _given(field: str, kind: str, value) -> list[tuple[str, GuidedSpec]]:
    """[(field, its spec)] when the field is given, else []."""
    if value is None:
        return []
    if kind == "json_schema":
        return [(field, _json_spec(field, value))]
    return [(field, _spec(field, kind, json.dumps(list(value)) if kind == "choice" else value))]


def _sources(body) -> list[tuple[str, GuidedSpec | None]]:
    found: list[tuple[str, GuidedSpec | None]] = []
    if body.response_format is not None:
        found.append(("response_format", _response_format(body.response_format)))
    for name, kind in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                       ("grammar", "grammar")):
        found += _given(f"guided_{name}", kind, getattr(body, f"guided_{name}"))
    so = body.structured_outputs
    if so is not None:
        found += _given("structured_outputs.json", "json_schema", so.json_)
        for name in ("regex", "choice", "grammar"):
            found += _given(f"structured_outputs.{name}", name, getattr(so, name))
        found += _given("structured_outputs.json_object", "json_schema",
                        JSON_OBJECT_SCHEMA if so.json_object else None)
    return found


def constraint_of(body, template: str | None = None) -> Constraint:
    """The request's constraint (not compiled yet); template: the model's chat template,
    whose tool-call form the calls follow. APIError (400) naming the field."""
    found = _sources(body)
    given = [(f, s) for f, s in found if s is not None]
    if len(given) > 1:
        raise _bad(given[1][0], f"only one output constraint may be given; {given[0][0]} "
                                "is given too")
    field, spec = given[0] if given else ("", None)
    plan = tool_plan(body, template)
    if plan is None:
        return Constraint(spec, field)
    if plan.mode == "auto" and spec is not None and spec.kind != "json_schema":
        raise _bad(field, "with tools under tool_choice auto, only a JSON constraint may be "
                          "combined")
    return Constraint(plan.spec(spec if plan.mode == "auto" else None), "tools", plan)


def tool_plan(body, template: str | None = None) -> ToolPlan | None:
    """The request's use of tools, written in the form ``template`` (the model's chat
    template) teaches; None when the model may not call any."""
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None) or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise _bad("tool_choice", f"{_choice_name(choice)} needs tools, and none are given")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    size = sum(len(json.dumps(f.get("parameters") or {})) for f in functions)
    if size > MAX_GUIDED_CHARS:  # checked before any schema: the grammar could not take them
        raise _bad("tools", f"the tools' parameter schemas take {size} characters; at most "
                            f"{MAX_GUIDED_CHARS} (they become one grammar)")
    names = [f["name"] for f in functions]
    for i, f in enumerate(functions):
        if names.index(f["name"]) != i:
            raise _bad(f"tools.{i}.function.name", f"{f['name']!r} is given twice")
        if "parameters" in f:
            try:
                check_schema(f["parameters"])
            except ValueError as e:
                raise _bad(f"tools.{i}.function.parameters", str(e)) from None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise _bad("tool_choice", f"names function {name!r}, which is not in tools "
                                      f"({', '.join(names)})")
        return ToolPlan("named", (functions[names.index(name)],), False, tool_format(template))
    return ToolPlan(choice, tuple(functions), body.parallel_tool_calls, tool_format(template))


def _choice_name(choice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) \
        else repr(choice)
