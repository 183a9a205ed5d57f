"""Structured outputs at the HTTP edge: response_format, vLLM's guided_* and
structured_outputs, tools with every tool_choice, streaming equal to non-streaming,
and the bad-input 400s, which name the field and reach no worker. Real worker and
router processes on the flat tiny model."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from core.limits import MAX_GUIDED_CHARS, MAX_TOOLS
from router.http.errors import APIError
from router.openai_api import ChatCompletionRequest
from router.structured import constraint_of
from tests.cluster.launch import cluster
from tests.guided_cases import CHOICES, REGEXES, SCHEMAS, assert_matches, assert_valid

ARGS = ["--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "2048"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Now"}}
MSGS = [{"role": "user", "content": "what is it like outside?"}]


@pytest.fixture(scope="module")
def c(flat_model_dir):
    with cluster(flat_model_dir, "tcp", worker_args=ARGS,
                 router_args=["--local-prefill-threshold", "16", "--max-model-len", "2048"]) as cl:
        yield cl


def post(c, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(c.url + path, json={"max_tokens": 120, **body}, timeout=60)


def stream(c, body: dict, path: str = "/v1/chat/completions") -> list[dict]:
    with httpx.stream("POST", c.url + path, timeout=60,
                      json={"max_tokens": 120, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def _streamed_message(events: list[dict]) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) accumulated as the openai client does."""
    content, calls, reason = "", {}, None
    for e in events:
        choice = e["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part.get("function", {}).get("arguments", "")
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("name", ["flat_object", "nested_object", "array_of_objects",
                                  "any_of_objects", "optional_fields", "pydantic_like"])
def test_json_schema_response_format_streams_what_it_returns(c, name) -> None:
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        body = {"messages": MSGS, **sampling, "response_format": {
            "type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                   "strict": True}}}
        r = post(c, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert_valid(name, choice["message"]["content"])
        content, calls, reason = _streamed_message(stream(c, body))
        assert (content, calls, reason) == (choice["message"]["content"], [], "stop")
    c.leak_check()


def test_json_object_and_the_vllm_fields(c) -> None:
    r = post(c, {"messages": MSGS, "temperature": 0, "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]  # any object: unbounded, so the flat model may ramble on
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    for i, regex in enumerate(REGEXES):
        for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
            out = post(c, {"prompt": "code:", "seed": i, **body}, "/v1/completions").json()
            assert_matches(regex, out["choices"][0]["text"])
    for choices in CHOICES:
        out = post(c, {"messages": MSGS, "seed": 3, "guided_choice": choices}).json()
        assert out["choices"][0]["message"]["content"] in choices
    schema = SCHEMAS["defs_and_refs"]
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema}}):
        assert_valid("defs_and_refs", post(c, {"messages": MSGS, "seed": 5, **body}).json()
                     ["choices"][0]["message"]["content"])
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /(yes|no)/'
    for body in ({"guided_grammar": lark}, {"structured_outputs": {"grammar": lark}}):
        text = post(c, {"prompt": "q:", "seed": 1, **body}, "/v1/completions").json()[
            "choices"][0]["text"]
        assert text in ("The answer is yes.", "The answer is no.")
    c.leak_check()


def _check_calls(calls: list[dict], tools: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert calls
    for call in calls:
        fn = by_name[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            fn.get("parameters", {"type": "object"}))


@pytest.mark.parametrize("tool_choice", ["required", "named", "single"])
def test_tool_calls_validate_and_stream_the_same(c, tool_choice) -> None:
    tools = [WEATHER, CLOCK]
    body = {"messages": MSGS, "tools": tools, "temperature": 1.0, "seed": 21, "max_tokens": 600,
            "tool_choice": "required"}
    if tool_choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    if tool_choice == "single":
        body["parallel_tool_calls"] = False
    r = post(c, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
    _check_calls(msg["tool_calls"], tools)
    if tool_choice != "required":
        assert len(msg["tool_calls"]) == 1
    if tool_choice == "named":
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    content, calls, reason = _streamed_message(stream(c, body))
    assert (content, reason) == ("", "tool_calls")
    assert calls == [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                     for t in msg["tool_calls"]]
    c.leak_check()


def test_auto_and_tool_results_fed_back(c) -> None:
    for seed in range(4):
        body = {"messages": MSGS, "tools": [WEATHER], "temperature": 1.0, "seed": seed,
                "max_tokens": 300}
        msg = post(c, body).json()["choices"][0]["message"]
        if msg.get("tool_calls"):
            _check_calls(msg["tool_calls"], [WEATHER])
        else:
            assert not msg["content"].startswith("<")
        content, calls, _ = _streamed_message(stream(c, body))
        assert content == (msg["content"] or "")
        assert [x["name"] for x in calls] == [t["function"]["name"]
                                             for t in msg.get("tool_calls") or []]
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    r = post(c, {"messages": history, "tools": [WEATHER], "tool_choice": "none",
                 "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    c.leak_check()


def _requests_seen(c) -> float:
    total = 0.0
    for proc in c.prefill + c.decode:
        for line in c.metrics(proc).splitlines():
            if line.startswith("tandem:requests_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "response_format"),
    ({"guided_json": {"type": "array", "minItems": "two"}}, "guided_json"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"guided_json": SCHEMAS["defs_and_refs"], "max_tokens": 6}, "max_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "max_tokens": 10}, "max_tokens"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "a" * (MAX_GUIDED_CHARS + 1)}, "guided_regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                for i in range(MAX_TOOLS + 1)]}, "tools"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_a_400_naming_the_field_before_any_work(c, body, field) -> None:
    before = _requests_seen(c)
    r = post(c, {"messages": MSGS, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err
    assert _requests_seen(c) == before  # no worker saw it


def test_constraint_sources() -> None:
    def of(**body):
        return constraint_of(ChatCompletionRequest.model_validate({"messages": MSGS, **body}))
    assert of().spec is None and of(response_format={"type": "text"}).spec is None
    assert of(response_format={"type": "json_object"}).spec.kind == "json_schema"
    assert of(guided_regex="a+").field == "guided_regex"
    assert of(structured_outputs={"choice": ["a"]}).field == "structured_outputs.choice"
    assert of(tools=[CLOCK]).tools.mode == "auto"
    assert of(tools=[CLOCK], tool_choice="none").tools is None
    with pytest.raises(APIError, match="tool_choice"):
        of(tools=[CLOCK], tool_choice="auto", guided_regex="a")
