"""/v1/responses: a Responses request served as the chat completion it amounts to
(router/responses_api.py), rendered as a Response object, or streamed as the
Responses event types (response.created, output_item.added, content_part.added,
output_text.delta ..., function_call_arguments.delta/done, response.completed).

The request holds what a chat completion holds, on one AsyncExitStack (admission
slot, flow, accounting) that a non-streaming reply closes before returning and a
stream owns; a client that goes away cancels it and the stack frees everything.
The conversation (input and output, as chat messages) is stored for
previous_response_id when ``store`` is true (router/responses_store.py).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from router.flow import Delta
from router.http.batch import Endpoints
from router.http.errors import APIError
from router.http.intake import Intake, Reader
from router.http.owned import FLOW_ERRORS, Outcome, OwnedStream, echo_headers
from router.http.render import cached_details
from router.openai_api import ChatCompletionRequest
from router.responses_api import CHAT_FIELD, ResponsesRequest
from router.responses_store import ResponseStore
from router.tools import ToolCallText
from router.trace import Trace


class ResponsesReader(Reader):
    """Reads a /v1/responses body (router/http/intake.py's checks, then the chat request
    it amounts to)."""

    async def responses(self, request: Request, store: ResponseStore
                        ) -> tuple[ResponsesRequest, Intake, list[dict]]:
        """A /v1/responses body, the chat request it amounts to (router/responses_api.py)
        as an Intake, and the conversation so far (the stored one of
        previous_response_id, then this input); errors name the Responses field."""
        body = await self._validated(request, ResponsesRequest.model_validate_json)
        key = getattr(request.state, "api_key", None)
        try:
            body.refuse_unsupported()
            history = (store.get(key.name if key is not None else "", body.previous_response_id)
                       if body.previous_response_id else [])
            chat, added = body.chat(history)
            chat = ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            raise _as_responses(APIError.from_errors(e.errors())) from None
        except ValueError as e:
            raise APIError.invalid(e) from None
        request.state.priority = self._priority(request, chat)
        request.state.deadline = self._deadline(request)
        try:
            return body, await self._chat(request, chat), history + added
        except APIError as e:
            raise _as_responses(e) from None


def _as_responses(e: APIError) -> APIError:
    """An error about the chat request a Responses request became, naming the
    Responses field it came from (max_tokens: max_output_tokens, ...)."""
    if e.param is None:
        return e
    head = e.param.partition(".")[0]
    param = CHAT_FIELD.get(head, e.param.replace(".function.", ".", 1))
    message = e.message.replace(e.param, param, 1) if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, e.type, param, e.headers)


class _Reply:
    """One response's identity and the request fields it echoes."""

    def __init__(self, rid: str, body: ResponsesRequest, model: str, history: list[dict]) -> None:
        self.rid, self.body, self.model, self.history = rid, body, model, history
        self.created = int(time.time())
        self.seq = 0

    def obj(self, status: str, output: list[dict], trace: Trace | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) \
            if b.text is not None and b.text.format is not None else {"type": "text"}
        usage = None if trace is None else {
            "input_tokens": trace.prompt_tokens, "output_tokens": trace.output_tokens,
            "total_tokens": trace.prompt_tokens + trace.output_tokens,
            "input_tokens_details": cached_details(trace),
            "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "metadata": b.metadata or {}, "parallel_tool_calls": b.parallel_tool_calls,
                "previous_response_id": b.previous_response_id,
                "temperature": b.temperature, "top_p": b.top_p,
                "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice
                is None else b.tool_choice.model_dump(), "tools": [
                    t.model_dump(exclude_none=True) for t in b.tools or []],
                "text": {"format": fmt}, "store": b.store, "usage": usage}

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
        return f"event: {kind}\ndata: {data}\n\n"


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
        if status == "completed" else []
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": content}


def _call(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def _store(ep: Endpoints, request: Request, reply: _Reply, text: str,
           calls: list[dict] | None) -> None:
    """The conversation, this output included, for a later previous_response_id."""
    if not reply.body.store:
        return
    key = getattr(request.state, "api_key", None)
    turn = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
        {"role": "assistant", "content": text}
    ep.state.responses.put(key.name if key is not None else "", reply.rid,
                           reply.history + [turn])


async def serve_responses(ep: Endpoints, request: Request) -> Response:
    rid = f"resp_{uuid.uuid4().hex}"
    headers = echo_headers(request, rid)
    try:
        body, intake, history = await ResponsesReader(ep.state).responses(request,
                                                                          ep.state.responses)
    except APIError as e:
        return e.response(headers)
    reply = _Reply(rid, body, ep.state.model_name, history)
    stack: AsyncExitStack | None = AsyncExitStack()
    outcome = Outcome(Trace(rid, request.headers.get("x-request-id") or ""))
    try:
        deltas = await ep.start(stack, intake, rid, outcome)
        first = await deltas.__anext__()
        ep.state.metrics.ttft.observe(outcome.trace.ttft_seconds)
        if body.stream:
            events = _events(ep, request, reply, intake, first, deltas, outcome)
            resp = OwnedStream(events, stack, headers)
            stack = None  # the response owns it now
            return resp
        text, reason = first.text, first.finish_reason
        d = first
        while not d.finished:
            d = await deltas.__anext__()
            text, reason = text + d.text, d.finish_reason
        calls = intake.tools.parse(text) if intake.tools is not None and reason == "stop" else None
        outcome.reason = "tool_calls" if calls else reason or "error"
        _store(ep, request, reply, text, calls)
        output = [_call(c) for c in calls] if calls else [_message(text)]
        return JSONResponse(reply.obj(_status(reason), output, outcome.trace), headers=headers)
    except (StopAsyncIteration, *FLOW_ERRORS) as e:
        outcome.reason = "error"
        return APIError.from_flow(e).response(headers)
    finally:
        if stack is not None:
            await stack.aclose()


class _Streamed:
    """What the stream has sent of the message item, and the calls found at its end."""

    def __init__(self) -> None:
        self.msg = _message("", "in_progress")
        self.where = {"item_id": self.msg["id"], "output_index": 0, "content_index": 0}
        self.text, self.opened = "", False
        self.found: list[dict] | None = None
        self.last: Delta | None = None


async def _events(ep: Endpoints, request: Request, reply: _Reply, intake: Intake, first: Delta,
                  deltas: AsyncIterator[Delta], outcome: Outcome) -> AsyncIterator[str]:
    """The Responses event stream: a message item whose text streams as it comes (held
    back while it may be tool calls), then any function_call items, then the whole
    response."""
    st = _Streamed()
    try:
        yield reply.event("response.created", response=reply.obj("in_progress", []))
        yield reply.event("response.in_progress", response=reply.obj("in_progress", []))
        async for e in _text_events(reply, intake, first, deltas, st):
            yield e
        output: list[dict] = []
        for e in _item_events(reply, st, output):
            yield e
        reason = st.last.finish_reason
        outcome.reason = "tool_calls" if st.found else reason or "error"
        _store(ep, request, reply, st.text, st.found)
        status = _status(reason)
        yield reply.event(f"response.{status}", response=reply.obj(status, output,
                                                                   outcome.trace))
    except (StopAsyncIteration, *FLOW_ERRORS) as e:
        outcome.reason = "error"
        yield reply.event("error", code="server_error", message=str(e) or "stream ended early",
                          param=None)


async def _text_events(reply: _Reply, intake: Intake, d: Delta, deltas: AsyncIterator[Delta],
                       st: _Streamed) -> AsyncIterator[str]:
    """The message item's opening and text deltas (opened at its first text; an output
    with neither text nor calls still gets an empty message)."""
    calls = ToolCallText(intake.tools) if intake.tools is not None else None
    while True:
        piece = d.text if calls is None else calls.feed(d.text)
        if d.finished and calls is not None:
            owed, st.found = calls.finish(d.finish_reason)
            piece += owed
        if not st.opened and (piece or (d.finished and not st.found)):
            st.opened = True
            yield reply.event("response.output_item.added", output_index=0, item=st.msg)
            yield reply.event("response.content_part.added", **st.where, part={
                "type": "output_text", "text": "", "annotations": [], "logprobs": []})
        if piece:
            st.text += piece
            yield reply.event("response.output_text.delta", **st.where, delta=piece,
                              logprobs=[])
        if d.finished:
            st.last = d
            return
        d = await deltas.__anext__()


def _item_events(reply: _Reply, st: _Streamed, output: list[dict]) -> list[str]:
    """The message item's closing events, then each function call's; output gets the
    finished items."""
    out = []
    if st.opened:
        done = _message(st.text, item_id=st.msg["id"])
        out += [reply.event("response.output_text.done", **st.where, text=st.text, logprobs=[]),
                reply.event("response.content_part.done", **st.where, part=done["content"][0]),
                reply.event("response.output_item.done", output_index=0, item=done)]
        output.append(done)
    for call in st.found or []:
        i, item = len(output), _call(call)
        args = {"item_id": item["id"], "output_index": i}
        out += [reply.event("response.output_item.added", output_index=i,
                            item=_call(call, "in_progress")),
                reply.event("response.function_call_arguments.delta", **args,
                            delta=item["arguments"]),
                reply.event("response.function_call_arguments.done", **args,
                            name=item["name"], arguments=item["arguments"]),
                reply.event("response.output_item.done", output_index=i, item=item)]
        output.append(item)
    return out
