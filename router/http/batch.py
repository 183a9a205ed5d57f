"""Several choices in one response: a batch of prompts on /v1/completions, n > 1 (chat
and completions), or both; best_of.

Each prompt is a request of its own (its own admission slot, flow, accounting and
internal id ``{rid}-p{i}``; ``rid`` for a single prompt), run side by side in a task
that holds everything the sub-request holds on its own AsyncExitStack and puts its
deltas on one queue. A prompt's n choices come from its one flow (the engine forks
them, engine/fork.py), each delta tagged with its choice. The response is sent once
every choice has its first token (so a refusal, 429 or 503 is the whole response's
status, as for one prompt); choice j of prompt i is index i*n + j, as OpenAI numbers
them. With best_of, each prompt generates best_of sequences and the response keeps
the n with the highest cumulative logprob, best first (not streamed: the best are
known only at the end). Whoever ends the batch, its last delta, an error,
or a client that goes away (the handler or the stream is cancelled), cancels every
task still running, and each task's stack then frees what its sub-request holds:
the slot, and the flow, which aborts it on every worker.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
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

    def shape(self, intake: Intake, rid: str, trace: Trace,
              index: int = 0) -> ResponseShape: ...


@dataclass
class _Choice:
    """One sequence's part of the response, as its deltas arrive."""

    shape: ResponseShape
    prompt: int
    deltas: list[Delta] = field(default_factory=list)
    """What arrived before the response started (all of it, when not streaming)."""
    finished: bool = False
    reason: str = "error"

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for d in self.deltas for lp, _ in d.logprobs)


class _Batch:
    def __init__(self, ep: Endpoints, request: Request, intakes: list[Intake],
                 rid: str) -> None:
        self.ep, self.intakes = ep, intakes
        self.n, self.seqs = intakes[0].n, intakes[0].params.n
        """Choices returned and sequences generated per prompt (more with best_of)."""
        xrid = request.headers.get("x-request-id") or ""
        self.outcomes = [Outcome(Trace(rid if len(intakes) == 1 else f"{rid}-p{i}", xrid))
                         for i in range(len(intakes))]
        traces = [o.trace for o in self.outcomes]
        self.choices = [_Choice(ep.shape(it, rid, traces[i], i * self.seqs + j), i)
                        for i, it in enumerate(intakes) for j in range(self.seqs)]
        self.queue: asyncio.Queue[tuple[int, Delta | Exception]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(len(intakes))]

    async def _run(self, i: int) -> None:
        """Sub-request i, start to end, each delta on the queue under its choice's
        slot (an error as its last)."""
        outcome, mine = self.outcomes[i], self.choices[i * self.seqs:(i + 1) * self.seqs]
        try:
            async with AsyncExitStack() as stack:
                deltas = await self.ep.start(stack, self.intakes[i],
                                             outcome.trace.request_id, outcome)
                first, left = True, len(mine)
                async for d in deltas:
                    if first:
                        self.ep.state.metrics.ttft.observe(outcome.trace.ttft_seconds)
                        first = False
                    if d.finished:
                        mine[d.index].reason = outcome.reason = d.finish_reason or "error"
                        left -= 1
                    self.queue.put_nowait((i * self.seqs + d.index, d))
                    if left == 0:
                        return
                raise StopAsyncIteration
        except (StopAsyncIteration, *FLOW_ERRORS) as e:
            outcome.reason = "error"
            self.queue.put_nowait((i * self.seqs, e))

    async def next(self) -> tuple[int, Delta]:
        """The next delta of any choice; a sub-request's error raises here."""
        i, item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        self.choices[i].finished = item.finished
        return i, item

    async def until_started(self) -> None:
        """Buffer deltas until every choice has its first one."""
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
    """The whole response: choice j of prompt i at index i*n + j (with best_of, the n
    best of its sequences, best first), usage summed over every sequence."""
    choices, top = [], {}
    for i in range(len(batch.intakes)):
        mine = batch.choices[i * batch.seqs:(i + 1) * batch.seqs]
        if batch.seqs > batch.n:
            mine = sorted(mine, key=lambda c: -c.cumulative_logprob)[:batch.n]
        for j, c in enumerate(mine):
            ds = c.deltas
            full = replace(c.shape, index=i * batch.n + j).full(
                "".join(d.text for d in ds), ds[-1].finish_reason,
                [t for d in ds for t in d.token_ids], [lp for d in ds for lp in d.logprobs],
                batch.outcomes[i].trace, ds[0].prompt_logprobs)
            choices.append(full.pop("choices")[0])
            top = full
    top.update(choices=choices, usage=usage(*(o.trace for o in batch.outcomes)))
    return top


async def _sse(batch: _Batch) -> AsyncIterator[str]:
    """Each choice's chunks under its index, interleaved as they come (a chat choice
    opens with its role); a choice's last chunk carries its finish_reason; usage
    (summed) once all have finished."""
    opened = [False] * len(batch.choices)

    def events(i: int, d: Delta) -> list[str]:
        c, out = batch.choices[i], []
        if c.shape.chat and not opened[i]:
            out.append(c.shape.chunk(None, None, role=True, first=True))
            opened[i] = True
        if d.text or (d.token_ids and (c.shape.logprobs or c.shape.prompt_ids is not None)) \
                or (c.shape.prompt is not None and not opened[i]):
            out.append(c.shape.chunk(d.text, None, d=d, first=not opened[i]))
            opened[i] = True
        if d.finished:
            out.append(c.shape.chunk(None if c.shape.chat else "", c.reason))
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
            yield shape.usage_chunk(*(o.trace for o in batch.outcomes))
        yield "data: [DONE]\n\n"
    except (StopAsyncIteration, *FLOW_ERRORS) as e:
        yield shape.error_event(str(e) or "stream ended early")
