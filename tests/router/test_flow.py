"""The request flow's retry policy against fake workers: one deadline for the whole
request (retries included), and UNKNOWN (an unhandled error in a worker) is not
retried, so one poison request cannot mark every worker down."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from engine.sampling import SamplingParams
from proto import common_pb2, decode_pb2
from router.config import RouterConfig
from router.flow import RequestFlow, Trace
from router.outcomes import WorkerError
from router.prefix_index import PrefixIndex
from router.workers import Worker


class FakeDecode:
    def __init__(self, fail: grpc.StatusCode | None, delay: float = 0.0) -> None:
        self.fail, self.delay, self.timeouts, self.ids = fail, delay, [], []

    def Generate(self, req, timeout):
        self.timeouts.append(timeout)
        self.ids.append(req.request_id)
        return self._stream(req)

    async def _stream(self, req):
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="injected")
        yield decode_pb2.GenerateChunk(token_ids=[5], finished=True, finish_reason="length",
                                       trace=decode_pb2.KVTrace())

    async def Abort(self, req, timeout):
        return common_pb2.AbortReply(aborted=True)


class FakePool:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers, self.index, self.down = workers, PrefixIndex(), []

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w not in self.down]

    def mark_down(self, w: Worker) -> None:
        self.down.append(w)


class Tok:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _flow(*stubs) -> tuple[RequestFlow, list[Worker]]:
    workers = [Worker(f"127.0.0.1:{9000 + i}", "decode", None, s, healthy=True)
               for i, s in enumerate(stubs)]
    cfg = RouterConfig(local_prefill_threshold=None, routing="round_robin")
    return RequestFlow(cfg, Tok(), FakePool(workers)), workers


async def _collect(flow: RequestFlow, deadline: float):
    return [d async for d in flow.run([1, 2, 3], SamplingParams(max_tokens=1), 0, "rid",
                                      deadline=deadline)]


def test_retries_share_one_deadline() -> None:
    async def body():
        first, second = FakeDecode(grpc.StatusCode.UNAVAILABLE, delay=0.3), FakeDecode(None)
        flow, _ = _flow(first, second)
        out = await _collect(flow, time.monotonic() + 10)
        assert out[-1].finished
        assert first.timeouts[0] <= 10
        assert second.timeouts[0] <= first.timeouts[0] - 0.25  # what the first attempt used
        assert (first.ids, second.ids) == (["rid-0"], ["rid-1"])  # per-attempt worker ids
    asyncio.run(body())


def test_unknown_is_not_retried() -> None:
    async def body():
        first, second = FakeDecode(grpc.StatusCode.UNKNOWN), FakeDecode(None)
        flow, workers = _flow(first, second)
        with pytest.raises(WorkerError) as e:
            await _collect(flow, time.monotonic() + 10)
        assert e.value.code == grpc.StatusCode.UNKNOWN
        assert second.timeouts == [] and flow.pool.down == []
    asyncio.run(body())


class SpeculatingDecode(FakeDecode):
    """Two chunks, the last with the worker's speculation figures for the request."""

    async def _stream(self, req):
        yield decode_pb2.GenerateChunk(token_ids=[5, 6, 7], trace=decode_pb2.KVTrace())
        yield decode_pb2.GenerateChunk(
            token_ids=[8], finished=True, finish_reason="length",
            spec=decode_pb2.SpecTrace(proposed_tokens=6, accepted_tokens=2, verifications=2))


def test_the_trace_carries_the_decode_workers_speculation() -> None:
    async def body():
        flow, _ = _flow(SpeculatingDecode(None))
        trace = Trace("rid")
        out = [d async for d in flow.run([1, 2, 3], SamplingParams(max_tokens=4), 0, "rid",
                                         trace=trace, deadline=time.monotonic() + 10)]
        assert out[-1].finished
        got = json.loads(trace.json())
        assert (got["spec_proposed_tokens"], got["spec_accepted_tokens"],
                got["spec_verifications"]) == (6, 2, 2)
    asyncio.run(body())
