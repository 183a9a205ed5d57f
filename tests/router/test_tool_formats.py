"""A chat completion with tools on a Qwen2-style model (the qwen2 family's random
checkpoint with Qwen2.5's chat template, whose tool section teaches ``<tool_call>``
blocks): the constrained output is written in that form, token for token, and comes
back as OpenAI tool_calls, streamed and not; parallel_tool_calls false gives one call.

One in-process decode worker behind the router's app (router/tool_formats.py picks
the form from the template the router loaded)."""
from __future__ import annotations

import asyncio
import json
import re

import httpx

from core.tokenizer import Tokenizer
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from router.flow import RequestFlow
from router.metrics import RouterMetrics
from router.state import RouterState
from tests.models.families import build_checkpoint

QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are Qwen.\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen2.5-Instruct's chat template, cut to its tool section and plain turns."""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
BLOCK = r'<tool_call>\n\{"name": "get_\w+", "arguments": \{.*?\}\}\n</tool_call>'
EOS = 2  # <|im_end|>, Qwen's end of turn


def _model(root):
    build_checkpoint(root, "qwen2", max_position_embeddings=1024, eos_token_id=EOS)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": QWEN25_TEMPLATE}))
    return root


def _app(root, pool):
    cfg = RouterConfig(model=str(root), decode=("127.0.0.1:1",), local_prefill_threshold=None)
    app, tok = create_app(cfg), Tokenizer.load(root)
    app.state.router = RouterState(cfg, "qwen2", tok, pool, RequestFlow(cfg, tok, pool),
                                   RouterMetrics(), Admission(8, 8))
    return app, tok


def _body(**extra) -> dict:
    # EOS is raised where the grammar allows it (after a block), so the random model
    # ends after its calls rather than writing blocks until max_tokens
    return {"model": "qwen2", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0,
            "max_tokens": 120, "logit_bias": {str(EOS): 100}, **extra}


def _streamed_calls(text: str) -> tuple[list[tuple[str, str]], str]:
    """(name, arguments) of each streamed call (OpenAI's deltas joined by index), and
    the finish reason."""
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for part in ch["choices"][0]["delta"].get("tool_calls") or []:
            name, args = calls.setdefault(part["index"], ["", ""])
            fn = part["function"]
            calls[part["index"]] = [name + fn.get("name", ""), args + fn["arguments"]]
    return [tuple(c) for c in calls.values()], chunks[-1]["choices"][0]["finish_reason"]


async def _requests(app, tok: Tokenizer) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router", timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=_body(return_token_ids=True))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        raw = tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert re.fullmatch(f"{BLOCK}(\\n{BLOCK})*", raw), raw  # Qwen's form, not an array
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"]["tool_calls"]]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [json.dumps({"name": n, "arguments": json.loads(a)}) for n, a in calls] == \
            re.findall(r"<tool_call>\n(.*?)\n</tool_call>", raw)
        r = await client.post("/v1/chat/completions", json=_body(stream=True))
        assert _streamed_calls(r.text) == (calls, "tool_calls")
        r = await client.post("/v1/chat/completions", json=_body(parallel_tool_calls=False))
        assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_qwen_template_gets_tool_call_blocks(tmp_path) -> None:
    from decode_svc.service import DecodeService
    from router.discovery.base import WorkerEndpoint
    from router.workers import WorkerPool
    from tests.services.conftest import leak_check, worker_config

    root = _model(tmp_path)

    async def body():
        d = DecodeService(worker_config(root, engine=dict(max_model_len=1024), kv_blocks=128))
        await d.start()
        pool = WorkerPool(d.secret)
        try:
            await pool.apply(frozenset({WorkerEndpoint("decode", f"127.0.0.1:{d.port}")}))
            await pool.wait_healthy(30)  # as the router's start-up does; else a 503
            await _requests(*_app(root, pool))
            await leak_check(d)
        finally:
            await pool.stop()
            await d.stop(0)
    asyncio.run(body())
