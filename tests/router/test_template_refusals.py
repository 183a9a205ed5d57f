"""Chat templates that refuse a conversation (Gemma 2's and Mistral's first templates
call raise_exception on a system turn): the refusal is a 400 naming the field, not a
server error. With tools, such a template cannot be told them (it renders no tools and
refuses the system turn that would describe them), so the 400 names ``tools``.

The router's app in-process over no workers: /tokenize renders messages exactly as
/v1/chat/completions does (router/http/intake.py), and a refusal comes before any
worker is chosen."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from core.tokenizer import Tokenizer
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from router.flow import RequestFlow
from router.metrics import RouterMetrics
from router.state import RouterState
from tests.router.test_flow import FakePool

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
"""Gemma 2's chat template as its checkpoints ship it (tokenizer_config.json)."""
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "what time is it"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2-template")
    (root / "tokenizer.json").symlink_to(tiny_model_dir / "tokenizer.json")
    (root / "config.json").symlink_to(tiny_model_dir / "config.json")
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "chat_template": GEMMA2_TEMPLATE}))
    cfg = RouterConfig(model=str(root), decode=("127.0.0.1:1",), local_prefill_threshold=None)
    app, tok, pool = create_app(cfg), Tokenizer.load(root), FakePool([])
    app.state.router = RouterState(cfg, "gemma2", tok, pool, RequestFlow(cfg, tok, pool),
                                   RouterMetrics(), Admission(8, 8))
    return TestClient(app)  # no lifespan: no worker pool to poll


def test_a_template_renders_what_it_accepts(client) -> None:
    r = client.post("/tokenize", json={"messages": USER, "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert "".join(r.json()["token_strs"]).startswith("<|endoftext|><start_of_turn>user\n")


@pytest.mark.parametrize("messages,extra,param,says", [
    ([{"role": "system", "content": "be brief"}, *USER], {}, "messages",
     "System role not supported"),
    (USER * 2, {}, "messages", "Conversation roles must alternate"),
    (USER, {"tools": TOOLS}, "tools", "System role not supported"),
])
def test_a_templates_refusal_is_a_400_naming_the_field(client, messages, extra, param,
                                                       says) -> None:
    r = client.post("/tokenize", json={"messages": messages, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
