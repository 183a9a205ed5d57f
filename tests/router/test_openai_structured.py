"""Structured outputs through the official openai client against `tandem up` on the
real model (SmolLM2): chat.completions.parse with a pydantic response_format gives a
parsed object, tool_choice="required" gives calls whose arguments validate, and
streaming gives what the plain call gives."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.cluster.launch import tandem_up

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(model_path):
    with tandem_up(model_path, ["--kv-transfer", "tcp", "--kv-blocks", "256", "--max-model-len",
                                "2048", "--local-prefill-threshold", "16"], ready_s=240) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        c.model = c.models.list().data[0].id
        yield c


PEOPLE = [[{"role": "user", "content": "Alice is 30 years old. Extract the person as JSON."}],
          [{"role": "system", "content": "You extract data."},
           {"role": "user", "content": "Bob, aged 41, lives in Leeds. Who is he?"}]]


@pytest.mark.parametrize("messages", PEOPLE)
def test_parse_with_a_pydantic_model(client, messages) -> None:
    r = client.chat.completions.parse(model=client.model, messages=messages,
                                      response_format=Person, temperature=0, max_tokens=100)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=client.model, messages=messages,
                                        response_format=Person, temperature=0,
                                        max_tokens=100) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == person


def test_json_object(client) -> None:
    r = client.chat.completions.create(
        model=client.model, temperature=0, max_tokens=100, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a key 'colour'."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("seed", [None, 3])
def test_required_tool_calls_validate_and_stream_the_same(client, seed) -> None:
    kw = dict(model=client.model, tools=[WEATHER], tool_choice="required", max_tokens=150,
              messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              temperature=0 if seed is None else 0.8, seed=seed)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            name_args = calls.setdefault(part.index, ["", ""])
            name_args[0] += part.function.name or ""
            name_args[1] += part.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls"
    assert [tuple(v) for _, v in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_parse_tool_arguments_and_feed_the_result_back(client) -> None:
    tool = openai.pydantic_function_tool(Person, name="save_person")
    msgs = [{"role": "user", "content": "Save this person: Carol, 52."}]
    r = client.chat.completions.parse(model=client.model, messages=msgs, tools=[tool],
                                      tool_choice="required", temperature=0, max_tokens=100)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Person)
    follow = client.chat.completions.create(
        model=client.model, temperature=0, max_tokens=30, tools=[tool],
        messages=msgs + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "saved"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
