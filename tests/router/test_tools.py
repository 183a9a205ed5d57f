"""Tool calling's pieces at the edge: the grammar of each tool_choice, how tools and
earlier calls reach a template with and without tool support, and how output becomes
message.tool_calls (streamed and not)."""
from __future__ import annotations

import json

import pytest

from core.guided.compiler import GrammarCompiler
from core.tokenizer import Tokenizer
from router.tool_formats import HERMES, LLAMA3_JSON, tool_format
from router.tools import TOOL_OPEN, ToolCallText, ToolPlan, parse_calls, template_messages

WEATHER = {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time"}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.load(tiny_model_dir))


def _call(name: str, args: dict) -> dict:
    return {"name": name, "arguments": args}


def _text(*calls: dict) -> str:
    return f"{TOOL_OPEN}{json.dumps(list(calls))}</tool_call>"


def test_required_grammar_takes_calls_of_offered_tools_only(compiler) -> None:
    spec = ToolPlan("required", (WEATHER, TIME)).spec()
    ok = _text(_call("get_weather", {"city": "Oslo"}), _call("get_time", {}))
    assert compiler.accepts(spec, ok)
    assert not compiler.accepts(spec, _text(_call("get_weather", {"town": "Oslo"})))
    assert not compiler.accepts(spec, _text(_call("launch", {})))
    assert not compiler.accepts(spec, "The weather is fine.")
    single = ToolPlan("required", (WEATHER, TIME), parallel=False).spec()
    assert not compiler.accepts(single, ok)
    assert compiler.accepts(single, _text(_call("get_time", {})))


def test_named_and_auto_grammars(compiler) -> None:
    named = ToolPlan("named", (TIME,), parallel=False).spec()
    assert compiler.accepts(named, _text(_call("get_time", {})))
    assert not compiler.accepts(named, _text(_call("get_weather", {"city": "x"})))
    auto = ToolPlan("auto", (WEATHER,)).spec()
    assert compiler.accepts(auto, "Sunny, 20 degrees.")
    assert compiler.accepts(auto, _text(_call("get_weather", {"city": "Rome"})))
    assert not compiler.accepts(auto, "<b>bold</b>")  # text may not look like a call
    from core.guided.spec import GuidedSpec
    json_auto = ToolPlan("auto", (WEATHER,)).spec(GuidedSpec.json_schema({"type": "object"}))
    assert compiler.accepts(json_auto, '{"a": 1}')
    assert not compiler.accepts(json_auto, "plain text")


def test_parse_calls_gives_openai_tool_calls() -> None:
    calls = parse_calls(_text(_call("get_weather", {"city": "Oslo"}), _call("get_time", {})))
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls("no calls here") is None
    assert parse_calls(TOOL_OPEN + "[{broken") is None


def test_streamed_tool_text() -> None:
    held = ToolCallText(ToolPlan("required", (TIME,)))
    text = _text(_call("get_time", {}))
    assert held.feed(text[:5]) == "" and held.feed(text[5:]) == ""
    owed, calls = held.finish("stop")
    assert owed == "" and calls[0]["function"]["name"] == "get_time"
    cut = ToolCallText(ToolPlan("required", (TIME,)))
    cut.feed(text[:9])
    assert cut.finish("length") == (text[:9], None)  # an unfinished call stays text
    auto = ToolCallText(ToolPlan("auto", (TIME,)))
    assert auto.feed("Hello") == "Hello" and auto.feed(" there") == " there"
    assert auto.finish("stop") == ("", None)


def test_tools_reach_a_template_without_tool_support_as_a_system_block() -> None:
    plan = ToolPlan("auto", (WEATHER,))
    history = [{"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                            {"type": "text", "text": "Oslo?"}]},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]
    msgs, extra = template_messages(history, plan, "{{ messages }}")
    assert extra == {}
    assert msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert msgs[1]["content"] == "Weather in Oslo?"
    assert msgs[2]["content"] == _text(_call("get_weather", {"city": "Oslo"}))
    assert "tool_calls" not in msgs[2]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}
    with_system = template_messages([{"role": "system", "content": "Be brief."}] + history,
                                    plan, None)[0]
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 4


def test_tools_reach_a_template_with_tool_support_as_transformers_passes_them() -> None:
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    msgs, extra = template_messages(history, ToolPlan("auto", (TIME,)),
                                    "{% for t in tools %}{{ t }}{% endfor %}")
    assert extra == {"tools": [{"type": "function", "function": TIME}]}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {}  # an object, not text


QWEN_TOOLS = ('{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{ tool | tojson }}'
              '{%- endfor %}{{- "</tools>\\nFor each function call, return a json object within '
              '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
              '\\"arguments\\": <args-json-object>}\\n</tool_call>" }}{%- endif %}')
LLAMA3_TOOLS = ("{%- if tools is not none %}{{- 'Respond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}.' }}{%- endif %}")
MISTRAL_TOOLS = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"


@pytest.mark.parametrize("template,name", [
    (QWEN_TOOLS, "hermes"), (LLAMA3_TOOLS, "llama3_json"), (MISTRAL_TOOLS, "array"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "array"), (None, "array")])
def test_the_chat_template_picks_the_call_format(template, name) -> None:
    assert tool_format(template).name == name


def _hermes(*calls: dict) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def test_hermes_calls_are_one_block_each(compiler) -> None:
    two = _hermes(_call("get_weather", {"city": "Oslo"}), _call("get_time", {}))
    spec = ToolPlan("required", (WEATHER, TIME), format=HERMES).spec()
    assert compiler.accepts(spec, two)
    assert not compiler.accepts(spec, _text(_call("get_time", {})))  # not the array form
    single = ToolPlan("required", (WEATHER, TIME), parallel=False, format=HERMES).spec()
    assert not compiler.accepts(single, two)
    assert compiler.accepts(single, _hermes(_call("get_time", {})))
    auto = ToolPlan("auto", (WEATHER,), format=HERMES).spec()
    assert compiler.accepts(auto, "Sunny.") and not compiler.accepts(auto, "<b>x</b>")
    calls = HERMES.parse(two)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert HERMES.parse(two + " and more") is None and HERMES.parse("Sunny.") is None
    assert HERMES.parse("<tool_call>\n{broken\n</tool_call>") is None


def test_llama3_calls_are_one_object_with_parameters(compiler) -> None:
    call = json.dumps({"name": "get_weather", "parameters": {"city": "Rome"}})
    spec = ToolPlan("required", (WEATHER, TIME), format=LLAMA3_JSON).spec()
    assert compiler.accepts(spec, call)
    assert not compiler.accepts(spec, json.dumps(_call("get_weather", {"city": "Rome"})))
    assert not compiler.accepts(spec, call + "\n" + call)
    auto = ToolPlan("auto", (WEATHER,), format=LLAMA3_JSON).spec()
    assert compiler.accepts(auto, "Rain.") and not compiler.accepts(auto, '{"a": 1}')
    (parsed,) = LLAMA3_JSON.parse(call)
    assert json.loads(parsed["function"]["arguments"]) == {"city": "Rome"}


def test_streamed_hermes_text() -> None:
    text = _hermes(_call("get_time", {}))
    held = ToolCallText(ToolPlan("auto", (TIME,), format=HERMES))
    assert held.feed(text[:3]) == "" and held.feed(text[3:]) == ""
    owed, calls = held.finish("stop")
    assert owed == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    plain = ToolCallText(ToolPlan("auto", (TIME,), format=LLAMA3_JSON))
    assert plain.feed("It is") == "It is" and plain.finish("stop") == ("", None)
