"""One streaming request against an OpenAI-compatible endpoint, timed per event.

Every Server-Sent Event that carries text is timestamped on arrival
(``time.perf_counter``); TTFT, the inter-token latencies and TPOT are derived
from those stamps, never measured by a second clock:

* TTFT = first text-bearing event - request sent
* ITL  = gaps between successive text-bearing events (a server that packs
  several tokens into one event shows one longer gap, as in vLLM's benchmark)
* TPOT = (e2e - TTFT) / (output_tokens - 1), output_tokens from the final
  ``usage`` chunk (``stream_options.include_usage``) when the server sends it,
  else the number of text-bearing events
* e2e  = [DONE] (or the end of the stream when there is none) - request sent
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.bench.datasets import BenchRequest


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The API root, ending in /v1."""
    model: str = ""
    """Model name sent in every request."""
    api_key: str | None = None
    """Sent as 'Authorization: Bearer KEY' when set."""
    chat: bool = False
    """/chat/completions with the prompt as one user message instead of /completions."""
    ignore_eos: bool = True
    """Send ignore_eos=true (vLLM/Tandem/llama.cpp extension) so outputs have max_tokens tokens."""
    temperature: float = 0.0
    """Sampling temperature sent with every request."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Merged into every request body (server-specific options)."""
    timeout_s: float = 600.0
    """Per-request timeout."""

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/chat/completions" if self.chat else "/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass
class RequestResult:
    """The timeline of one request. Times are perf_counter seconds."""

    request: BenchRequest
    sent: float
    """When the request was sent."""
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of each text-bearing event."""
    done: float | None = None
    """Arrival of [DONE] (or the end of the stream)."""
    usage_output_tokens: int | None = None
    """completion_tokens from the usage chunk, when the server sent one."""
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens, when the server reports it."""
    text: str = ""
    ended: float = 0.0
    """When send() returned, success or not."""

    @property
    def output_tokens(self) -> int:
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.chunk_times)

    @property
    def prompt_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None \
            else self.request.prompt_len

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n, ttft, e2e = self.output_tokens, self.ttft, self.e2e
        if n < 2 or ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (n - 1)

    def record(self) -> dict[str, Any]:
        """A JSON-friendly row (times relative to the send, in seconds)."""
        return {"tag": self.request.tag, "ok": self.ok, "error": self.error,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e, "sent": self.sent,
                "itls": [round(x, 6) for x in self.itls]}


def _event_text(event: dict[str, Any]) -> str:
    text = []
    for choice in event.get("choices") or ():
        if "delta" in choice:
            text.append((choice.get("delta") or {}).get("content") or "")
        else:
            text.append(choice.get("text") or "")
    return "".join(text)


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: BenchRequest) -> RequestResult:
    """Send one streaming request and timestamp its events. Never raises for HTTP or
    stream errors: they land in result.error with ok=False."""
    res = RequestResult(req, time.perf_counter())
    try:
        async with client.stream("POST", endpoint.url, json=endpoint.body(req),
                                 headers=endpoint.headers(), timeout=endpoint.timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            parts: list[str] = []
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                # After [DONE], read on to the end of the stream as the OpenAI SDK does:
                # closing the connection under the server's feet can cut its bookkeeping short.
                if res.done is not None or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.done = now
                    continue
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return res
                if event.get("usage"):
                    res.usage_output_tokens = event["usage"].get("completion_tokens")
                    res.usage_prompt_tokens = event["usage"].get("prompt_tokens")
                    details = event["usage"].get("prompt_tokens_details") or {}
                    res.usage_cached_tokens = details.get("cached_tokens")
                text = _event_text(event)
                if text:
                    res.chunk_times.append(now)
                    parts.append(text)
            if res.done is None:  # the stream ended without [DONE]
                res.done = time.perf_counter()
            res.text = "".join(parts)
            res.ok = bool(res.chunk_times)
            if not res.ok:
                res.error = "stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.ended = time.perf_counter()
    return res
