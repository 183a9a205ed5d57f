"""/v1/responses through the official client: responses.create (text and message
input, instructions), responses.stream (the Responses event types), responses.parse
(text.format json_schema), function tools and their outputs continued with
previous_response_id, usage; the per-key store's bounds and TTL; bad input names the
field. Each output is checked against the chat completion it amounts to."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from core.errors import FieldError
from router.responses_store import ResponseStore

FLAG_TOOL = {"type": "function", "name": "set_flag", "description": "set the flag",
             "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                            "required": ["on"], "additionalProperties": False},
             "strict": True}


class Flag(BaseModel):
    on: bool


def _chat(api, messages: list[dict], max_tokens: int = 6) -> str:
    r = api.client.chat.completions.create(model="", messages=messages, temperature=0,
                                           max_tokens=max_tokens)
    return r.choices[0].message.content


def _count(api, messages: list[dict]) -> int:
    return httpx.post(api.url + "/tokenize", json={"messages": messages},
                      timeout=30).json()["count"]


def test_text_and_message_input_are_the_chat_they_amount_to(api) -> None:
    r = api.client.responses.create(model="", input="hi there", instructions="be brief",
                                    temperature=0, max_output_tokens=6)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output_text == _chat(api, msgs)
    assert r.usage.input_tokens == _count(api, msgs) and r.usage.output_tokens <= 6
    assert r.status in ("completed", "incomplete")
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "hi there"}]}]
    same = api.client.responses.create(model="", input=items, temperature=0,
                                       max_output_tokens=6)
    assert same.output_text == r.output_text


def test_stream_sends_the_responses_events_and_the_same_text(api) -> None:
    kw = dict(model="", input="tell me", temperature=0, max_output_tokens=6)
    whole = api.client.responses.create(**kw)
    with api.client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    final = events[-1].response  # response.incomplete when cut by max_output_tokens
    assert final.output_text == whole.output_text and final.id != whole.id
    assert final.status == whole.status
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_then_its_output_with_previous_response_id(api) -> None:
    r = api.client.responses.create(model="", input="flip it", tools=[FLAG_TOOL],
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=120)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "set_flag"
    assert isinstance(json.loads(call.arguments)["on"], bool)
    nxt = api.client.responses.create(
        model="", previous_response_id=r.id, temperature=0, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}])
    assert nxt.previous_response_id == r.id
    conversation = [{"role": "user", "content": "flip it"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "ok"}]
    assert nxt.usage.input_tokens == _count(api, conversation)
    assert nxt.output_text == _chat(api, conversation, max_tokens=4)


def test_streamed_function_call(api) -> None:
    with api.client.responses.stream(model="", input="flip it", tools=[FLAG_TOOL],
                                     tool_choice="required", max_output_tokens=120,
                                     temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call"
    assert Flag.model_validate_json(final.output[0].arguments)


def test_parse_with_a_json_schema_text_format(api) -> None:
    r = api.client.responses.parse(model="", input="flag?", text_format=Flag,
                                   max_output_tokens=120)
    assert isinstance(r.output_parsed, Flag)


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "image_generation_call"}]}, "input.0"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "f",
                                        "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": "x", "bogus": 1}, "bogus"),
])
def test_bad_input_names_the_field(api, body, param) -> None:
    r = httpx.post(api.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_store_false_keeps_nothing(api) -> None:
    r = api.client.responses.create(model="", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        api.client.responses.create(model="", input="y", previous_response_id=r.id,
                                    max_output_tokens=2)


def test_store_is_per_key_bounded_and_expires() -> None:
    store = ResponseStore(ttl_s=60, max_per_key=2, max_total=3)
    store.put("a", "r1", [{"role": "user", "content": "1"}])
    with pytest.raises(FieldError):
        store.get("b", "r1")  # another key's response is not found
    store.put("a", "r2", [])
    store.put("a", "r3", [])  # the key's oldest goes
    with pytest.raises(FieldError):
        store.get("a", "r1")
    store.put("b", "r4", [])
    store.put("c", "r5", [])  # the oldest of all goes
    assert len(store) == 3 and store.get("a", "r3") == []
    with pytest.raises(FieldError):
        store.get("a", "r2")
    expired = ResponseStore(ttl_s=0)
    expired.put("a", "r", [])
    with pytest.raises(FieldError, match="expired"):
        expired.get("a", "r")


def test_a_client_gone_mid_stream_frees_everything(api) -> None:
    before = api.requests_total(finish_reason="abort")
    with httpx.stream("POST", api.url + "/v1/responses", timeout=60, json={
            "input": "a long story", "max_output_tokens": 900, "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    api.leak_check()
    assert api.load(api.decode[0]).num_running == 0
    assert api.requests_total(finish_reason="abort") == before + 1
