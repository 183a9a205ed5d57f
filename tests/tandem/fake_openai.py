"""A fake OpenAI streaming server on 127.0.0.1 with a known schedule.

Each request answers after ``ttft_s``, then one token every ``itl_s`` (deterministic
asyncio sleeps). Token i of a response is the text `` t{i}``; the prompt's token count
is its number of whitespace-separated words; the usage chunk carries both counts.
Special prompts: ``FAIL`` answers HTTP 500, ``STREAMERR`` breaks off mid-stream with an
error event. A body field ``no_usage: true`` leaves the usage chunk out. The server
counts requests and the most it had in flight at once.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)


def _event(base: dict, chat: bool, text: str | None, reason: str | None = None,
           role: bool = False) -> str:
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = {"role": "assistant", "content": ""} if role else \
            ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason}
    return f"data: {json.dumps({**base, 'object': obj, 'choices': [choice]})}\n\n"


async def _stream(body: dict, chat: bool, ttft_s: float, itl_s: float, stats: FakeStats):
    n = int(body.get("max_tokens") or 16)
    base = {"id": "cmpl-fake", "created": 0, "model": body.get("model", "fake")}
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    stats.in_flight += 1
    stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
    try:
        if chat:
            yield _event(base, chat, None, role=True)  # the role-only chunk carries no text
        await asyncio.sleep(ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(itl_s)
            if prompt == "STREAMERR" and i == 2:
                yield f"data: {json.dumps({'error': {'message': 'boom'}})}\n\n"
                return
            yield _event(base, chat, f" t{i}")
        yield _event(base, chat, None if chat else "", "length")
        if not body.get("no_usage") and (body.get("stream_options") or {}).get("include_usage"):
            obj = "chat.completion.chunk" if chat else "text_completion"
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                     "total_tokens": len(prompt.split()) + n}
            yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stats.in_flight -= 1


def make_app(ttft_s: float, itl_s: float, api_key: str | None, stats: FakeStats) -> Starlette:
    async def handle(request: Request, chat: bool):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        stats.requests += 1
        stats.bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt")
        if prompt == "FAIL":
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=500)
        return StreamingResponse(_stream(body, chat, ttft_s, itl_s, stats),
                                 media_type="text/event-stream")

    async def completions(request: Request):
        return await handle(request, chat=False)

    async def chat(request: Request):
        return await handle(request, chat=True)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models)])


class FakeOpenAI:
    """Runs the fake app with uvicorn on its own thread; use as a context manager."""

    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.01, api_key: str | None = None):
        self.stats = FakeStats()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(make_app(ttft_s, itl_s, api_key, self.stats), host="127.0.0.1",
                                port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
