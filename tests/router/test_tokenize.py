"""vLLM's /tokenize and /detokenize on the router: a prompt or chat messages (rendered
exactly as /v1/chat/completions renders them, tools included) to ids with their
count and the context window; ids back to text; bad bodies are 400s naming the field."""
from __future__ import annotations

import httpx
import pytest


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "now",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _post(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(api.url + path, json=body, timeout=60)


def test_tokenize_a_prompt(api, tiny_tok) -> None:
    r = _post(api, "/tokenize", {"prompt": "hello <|im_end|>"})
    assert r.status_code == 200, r.text
    ids = tiny_tok.encode("hello <|im_end|>")
    assert r.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                        "token_strs": None}
    strs = _post(api, "/tokenize", {"prompt": "hello <|im_end|>", "return_token_strs": True,
                                  "add_special_tokens": False}).json()["token_strs"]
    assert strs == ["h", "e", "l", "l", "o", " ", "<|im_end|>"]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tokenize_messages_as_chat_completions_renders_them(api, tools) -> None:
    extra = {"tools": tools} if tools else {}
    chat = api.client.chat.completions.create(model="", messages=MSGS, max_tokens=1,
                                            extra_body={"return_token_ids": True}, **extra)
    r = _post(api, "/tokenize", {"messages": MSGS, **extra}).json()
    assert r["tokens"] == chat.prompt_token_ids and r["count"] == chat.usage.prompt_tokens
    bare = _post(api, "/tokenize", {"messages": MSGS, "add_generation_prompt": False,
                                  **extra}).json()
    assert bare["tokens"] == r["tokens"][:bare["count"]] and bare["count"] < r["count"]


def test_detokenize_round_trips_and_keeps_special_tokens(api) -> None:
    ids = _post(api, "/tokenize", {"prompt": "héllo <|im_start|>x"}).json()["tokens"]
    assert _post(api, "/detokenize", {"tokens": ids}).json() == {"prompt": "héllo <|im_start|>x"}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 999999]}, 400, "tokens"),
    ("/detokenize", {"tokens": "x"}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
])
def test_bad_bodies_name_the_field(api, path, body, status, param) -> None:
    r = _post(api, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert httpx.post(api.url + "/tokenize", content=b"{not json", timeout=30).status_code == 400
