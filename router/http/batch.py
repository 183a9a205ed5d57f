"""A batch of prompts on /v1/completions: one response, a choice per prompt.

Each prompt is a request of its own (its own admission slot, flow, accounting and
internal id ``{rid}-p{i}``), run side by side in a task that holds everything the
sub-request holds on its own AsyncExitStack and puts its deltas on one queue. The
response is sent once every prompt has its first token (so a refusal, 429 or 503
is the whole response's status, as for one prompt); choice i is prompt i's
(OpenAI's numbering with n = 1). Whoever ends the batch, its last delta, an error,
or a client that goes away (the handler or the stream is cancelled), cancels every
task still running, and each task's stack then frees what its sub-request holds:
the slot, and the flow, which aborts it on every worker.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.flow import Delta
from router.http.errors import APIError
from router.http.intake import Intake
from router.http.owned import FLOW_ERRORS, Outcome, OwnedStream, echo_headers
from router.http.render import ResponseShape, usage
from router.state import RouterState
from router.trace import Trace


class Endpoints(Protocol):
    """What a batch uses of router/http/endpoints.py's Endpoints."""

    state: RouterState

    async def start(self, stack: AsyncExitStack, intake: Intake, rid: str,
                    outcome: Outcome) -> AsyncIterator[Delta]: ...

    def shape(self, intake: Intake, rid: str, index: int = 0) -> ResponseShape: ...


@dataclass
class _Choice:
    """One prompt's part of the response, as its deltas arrive."""

    shape: ResponseShape
    outcome: Outcome
    deltas: list[Delta] = field(default_factory=list)
    """What arrived before the response started (all of it, when not streaming)."""
    started: bool = False
    finished: bool = False


class _Batch:
    def __init__(self, ep: Endpoints, request: Request, intakes: list[Intake],
                 rid: str) -> None:
        self.ep, self.intakes = ep, intakes
        xrid = request.headers.get("x-request-id") or ""
        self.choices = [_Choice(ep.shape(it, rid, i), Outcome(Trace(f"{rid}-p{i}", xrid)))
                        for i, it in enumerate(intakes)]
        self.queue: asyncio.Queue[tuple[int, Delta | Exception]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(len(intakes))]

    async def _run(self, i: int) -> None:
        """Sub-request i, start to end, its deltas on the queue (an error as its last)."""
        choice = self.choices[i]
        try:
            async with AsyncExitStack() as stack:
                deltas = await self.ep.start(stack, self.intakes[i],
                                             choice.outcome.trace.request_id, choice.outcome)
                async for d in deltas:
                    if not choice.started:
                        self.ep.state.metrics.ttft.observe(choice.outcome.trace.ttft_seconds)
                    choice.started = True
                    if d.finished:
                        choice.outcome.reason = d.finish_reason or "error"
                    self.queue.put_nowait((i, d))
                    if d.finished:
                        return
                raise StopAsyncIteration
        except (StopAsyncIteration, *FLOW_ERRORS) as e:
            choice.outcome.reason = "error"
            self.queue.put_nowait((i, e))

    async def next(self) -> tuple[int, Delta]:
        """The next delta of any prompt; a sub-request's error raises here."""
        i, item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        self.choices[i].finished = item.finished
        return i, item

    async def until_started(self) -> None:
        """Buffer deltas until every prompt has its first one."""
        while not all(c.deltas or c.finished for c in self.choices):
            i, d = await self.next()
            self.choices[i].deltas.append(d)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def close(self) -> None:
        """Cancel every sub-request still running and wait for each to free what it holds."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def serve_batch(ep: Endpoints, request: Request, intakes: list[Intake],
                      rid: str) -> Response:
    headers = echo_headers(request, rid)
    batch = _Batch(ep, request, intakes, rid)
    stack: AsyncExitStack | None = AsyncExitStack()
    stack.push_async_callback(batch.close)
    try:
        if intakes[0].stream:
            await batch.until_started()
            resp = OwnedStream(_sse(batch), stack, headers)
            stack = None  # the response owns it now
            return resp
        while not batch.done:
            i, d = await batch.next()
            batch.choices[i].deltas.append(d)
        return JSONResponse(_full(batch), headers=headers)
    except (StopAsyncIteration, *FLOW_ERRORS) as e:
        return APIError.from_flow(e).response(headers)
    finally:
        if stack is not None:
            await stack.aclose()


def _full(batch: _Batch) -> dict:
    """The whole response: choice i from prompt i's deltas, usage summed."""
    choices = []
    for c in batch.choices:
        ds = c.deltas
        full = c.shape.full("".join(d.text for d in ds), ds[-1].finish_reason,
                            [t for d in ds for t in d.token_ids],
                            [lp for d in ds for lp in d.logprobs], c.outcome.trace,
                            ds[0].prompt_logprobs)
        choices.append(full["choices"][0])
    shape = batch.choices[0].shape
    return {"id": shape.id, "object": "text_completion", "created": shape.created,
            "model": shape.model, "choices": choices,
            "usage": usage(*(c.outcome.trace for c in batch.choices))}


async def _sse(batch: _Batch) -> AsyncIterator[str]:
    """Each prompt's chunks under its index, interleaved as they come; a choice's last
    chunk carries its finish_reason; usage (summed) once all have finished."""
    opened = [False] * len(batch.choices)

    def events(i: int, d: Delta) -> list[str]:
        c, out = batch.choices[i], []
        if d.text or (d.token_ids and (c.shape.logprobs or c.shape.prompt_ids is not None)) \
                or (c.shape.prompt is not None and not opened[i]):
            out.append(c.shape.chunk(d.text, None, d=d, first=not opened[i]))
            opened[i] = True
        if d.finished:
            out.append(c.shape.chunk("", c.outcome.reason))
        return out

    shape = batch.choices[0].shape
    try:
        for i, c in enumerate(batch.choices):
            for d in c.deltas:
                for e in events(i, d):
                    yield e
        while not batch.done:
            for e in events(*await batch.next()):
                yield e
        if shape.include_usage:
            yield shape.usage_chunk(*(c.outcome.trace for c in batch.choices))
        yield "data: [DONE]\n\n"
    except (StopAsyncIteration, *FLOW_ERRORS) as e:
        yield shape.error_event(str(e) or "stream ended early")
