"""The request flow's retry policy against fake workers: one deadline for the whole
request (retries included), and UNKNOWN (an unhandled error in a worker) is not
retried, so one poison request cannot mark every worker down."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from core.sampling import SamplingParams
from proto import common_pb2, decode_pb2, kv_link_pb2, prefill_pb2
from core.kv import hash_token_blocks
from router.config import RouterConfig
from router.flow import RequestFlow
from router.trace import Trace
from router.outcomes import WorkerError
from router.prefix_index import PrefixIndex
from router.workers import Worker


class FakeDecode:
    def __init__(self, fail: grpc.StatusCode | None, delay: float = 0.0) -> None:
        self.fail, self.delay, self.timeouts, self.ids = fail, delay, [], []
        self.salts: list[bytes] = []

    def Generate(self, req, timeout):
        self.timeouts.append(timeout)
        self.ids.append(req.request_id)
        self.salts.append(req.cache_salt)
        return self._stream(req)

    async def _stream(self, req):
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="injected")
        yield decode_pb2.GenerateChunk(token_ids=[5], finished=True, finish_reason="length",
                                       trace=decode_pb2.KVTrace())

    async def Abort(self, req, timeout):
        self.aborts = getattr(self, "aborts", []) + [req.request_id]
        return common_pb2.AbortReply(aborted=True)


class FakePool:
    router_id = "router-test"

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


class FakePrefill:
    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.salts: list[bytes] = []
        self.router_ids: list[str] = []

    async def Prefill(self, req, timeout):
        self.salts.append(req.cache_salt)
        self.router_ids.append(req.router_id)
        reply = prefill_pb2.PrefillResponse(request_id=req.request_id, first_token=4)
        reply.kv_handle.CopyFrom(kv_link_pb2.KVHandle(request_id=req.request_id, num_tokens=3))
        return reply

    async def Abort(self, req, timeout):
        self.aborts.append(req.request_id)
        return common_pb2.AbortReply(aborted=True)


class HandoffDecode(FakeDecode):
    """A decode worker whose first chunk says whether it ended the prefill's lease, and
    that finishes only after the router has had time to act on it."""

    def __init__(self, lease_ended: bool) -> None:
        super().__init__(None)
        self.lease_ended = lease_ended

    async def _stream(self, req):
        yield decode_pb2.GenerateChunk(token_ids=[5], trace=decode_pb2.KVTrace(
            lease_ended=self.lease_ended,
            fallback=decode_pb2.FALLBACK_REASON_UNSPECIFIED if self.lease_ended
            else decode_pb2.FALLBACK_UNKNOWN_PEER))
        await asyncio.sleep(0.2)
        yield decode_pb2.GenerateChunk(token_ids=[6], finished=True, finish_reason="length")


@pytest.mark.parametrize("lease_ended", [True, False])
def test_a_lease_the_decode_worker_did_not_end_is_ended_by_the_router(lease_ended) -> None:
    """A decode worker that recomputes without releasing the handle's lease (a source
    its peer list lacks, one it cannot reach or authenticate, a Release that did not
    get through) said so only as a fallback, and the router forgot the prefill worker:
    its blocks stayed leased until expiry (30 s). Now the router aborts it at once,
    while the stream goes on."""
    async def body():
        prefill, decode = FakePrefill(), HandoffDecode(lease_ended)
        workers = [Worker("127.0.0.1:9100", "prefill", None, prefill, healthy=True),
                   Worker("127.0.0.1:9101", "decode", None, decode, healthy=True)]
        cfg = RouterConfig(local_prefill_threshold=0, routing="round_robin")
        flow = RequestFlow(cfg, Tok(), FakePool(workers))
        deltas = flow.run([1, 2, 3, 4], SamplingParams(max_tokens=3), 0, "rid",
                          deadline=time.monotonic() + 10)
        seen = []
        async for d in deltas:
            seen.append((d.token_ids, list(prefill.aborts)))
        assert [t for t, _ in seen] == [[4], [5], [6]]
        # before the last chunk the prefill's lease was aborted, or left to its release
        assert seen[-1][1] == ([] if lease_ended else ["rid-0"])
        assert prefill.aborts == ([] if lease_ended else ["rid-0"])  # once, not again
        # the prefill names the router, so its lease ends soon if the router dies
        assert prefill.router_ids == ["router-test"]
    asyncio.run(body())


def test_a_salted_request_is_placed_by_its_salted_blocks_and_keeps_its_salt_on_retry() -> None:
    """The router hashes the prompt under the request's cache salt, as the workers do in
    their KV events, so it finds the tenant's blocks (routing stays prefix-aware within
    a tenant); the salt goes with the prefill and with every attempt after a failover."""
    async def body():
        salt = b"\x5a" * 32
        prompt = list(range(40))  # 2 full blocks of 16
        prefill, spare, holder = FakePrefill(), FakeDecode(None), FakeDecode(
            grpc.StatusCode.UNAVAILABLE)
        workers = [Worker("127.0.0.1:9200", "prefill", None, prefill, healthy=True),
                   Worker("127.0.0.1:9201", "decode", None, spare, healthy=True),
                   Worker("127.0.0.1:9202", "decode", None, holder, healthy=True)]
        cfg = RouterConfig(local_prefill_threshold=0)
        flow = RequestFlow(cfg, Tok(), FakePool(workers))
        for h in hash_token_blocks(prompt, cfg.block_size, cfg.hash_seed, salt=salt):
            flow.pool.index.stored(workers[2].address, h)  # its KV events: salted hashes
        out = [d async for d in flow.run(prompt, SamplingParams(max_tokens=2), 0, "rid",
                                         deadline=time.monotonic() + 10, cache_salt=salt)]
        assert out[-1].finished
        # an unsalted walk finds no overlap and the tie goes to the first decode worker
        assert (holder.ids, spare.ids) == (["rid-0"], ["rid-1"])
        assert holder.salts == spare.salts == [salt] and prefill.salts == [salt, salt]
    asyncio.run(body())


def test_a_request_that_finished_on_its_decode_worker_is_not_aborted_there() -> None:
    """The flow returned at the finished delta, so the generator never reached the line
    that forgot the decode worker, and every request ended with a needless Abort RPC."""
    async def body():
        decode = FakeDecode(None)
        flow, _ = _flow(decode)
        out = await _collect(flow, time.monotonic() + 10)
        assert out[-1].finished and getattr(decode, "aborts", []) == []
    asyncio.run(body())
