"""A constraint that is short to send and costly to check never stalls a worker: while
one is compiled (or its shortest output searched), the worker's health check and
GetLoad answer; the request then gets INVALID_ARGUMENT naming the budget (or runs,
when only the search ran out), and nothing is left held.

The probes run on a thread of their own with blocking channels: the services run on
this test's event loop, so a stalled loop would stall an asyncio probe too and hide
the stall. The check in flight is held until the probes have answered (then it runs
as it would), so what is asserted is that a check does not hold the event loop, with
no race against how long the check takes: a check run on the loop would keep the
probes from ever answering. (A 1 s deadline on the probes while the check ran failed
once on a loaded 2-core host: the test process's threads share one GIL.)"""
from __future__ import annotations

import asyncio
import json
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from auth.grpc_auth import sync_channel
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.guided_cases import COSTLY_TO_COMPILE, COSTLY_TO_SEARCH
from tests.services.conftest import leak_check, services

PROBE_SECONDS = 30
"""The probes' deadline: only a loop that never answers misses it (the check waits)."""

def _sampling(schema: dict, max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, guided=common_pb2.Guided(
        kind="json_schema", text=json.dumps(schema)))


class _Prober(threading.Thread):
    """Once the worker starts checking the constraint: its health and its load (that
    they answer is the point, not how fast: the check waits for ``answered``)."""

    def __init__(self, svc, started: threading.Event, answered: threading.Event) -> None:
        super().__init__(daemon=True)
        self.address, self.secret, self.started = f"127.0.0.1:{svc.port}", svc.secret, started
        self.answered = answered
        self.stub = (prefill_pb2_grpc.PrefillStub if svc.role == "prefill"
                     else decode_pb2_grpc.DecodeStub)
        self.answers: dict[str, object] = {}

    def run(self) -> None:
        if not self.started.wait(60):
            self.answers["error"] = "the worker never started checking the constraint"
            return
        try:
            with grpc.insecure_channel(self.address) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=PROBE_SECONDS)
                self.answers["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            with sync_channel(self.address, self.secret) as ch:
                load = self.stub(ch).GetLoad(common_pb2.LoadRequest(), timeout=PROBE_SECONDS)
                self.answers["load"] = load.worker_id
        except grpc.RpcError as e:
            self.answers["error"] = f"{e.code().name}: {e.details()}"
        finally:
            self.answered.set()


async def _signal_checks(svc, monkeypatch, hold: threading.Event | None = None
                         ) -> tuple[threading.Event, threading.Event]:
    """(set when svc's engine begins checking a constraint, set when that check ended);
    hold: the check waits for it (up to a minute) before it starts its work."""
    compiler = await svc.engine.run(lambda e: e.guided)
    started, ended, check = threading.Event(), threading.Event(), compiler.check

    def signalling_check(*args, **kwargs):
        started.set()
        try:
            if hold is not None:
                hold.wait(60)
            return check(*args, **kwargs)
        finally:
            ended.set()
    monkeypatch.setattr(compiler, "check", signalling_check)
    return started, ended


async def _probe_while_checking(svc, monkeypatch) -> _Prober:
    """A started prober that fires when svc's engine begins checking a constraint."""
    answered = threading.Event()
    started, _ = await _signal_checks(svc, monkeypatch, hold=answered)
    prober = _Prober(svc, started, answered)
    prober.start()
    return prober


def test_a_prefill_worker_answers_while_it_compiles_a_costly_constraint(tiny_model_dir,
                                                                        monkeypatch) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prober = await _probe_while_checking(p, monkeypatch)
            try:
                await ps.Prefill(prefill_pb2.PrefillRequest(
                    request_id="costly", token_ids=[3, 4, 5],
                    sampling=_sampling(COSTLY_TO_COMPILE, 8)), timeout=300)
                code, details = None, ""
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            await asyncio.to_thread(prober.join, 60)
            await leak_check(p, d)
            return prober.answers, code, details, p.load_proto()
    answers, code, details, load = asyncio.run(body())
    assert answers == {"health": "SERVING", "load": load.worker_id}
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "guided: takes more than 2 s to compile (the budget)"
    assert (load.num_waiting, load.num_running, load.active_leases) == (0, 0, 0)


def test_a_decode_worker_answers_while_it_searches_a_costly_constraint(tiny_model_dir,
                                                                       monkeypatch) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prober = await _probe_while_checking(d, monkeypatch)
            chunks = [c async for c in ds.Generate(decode_pb2.GenerateRequest(
                request_id="searchy", prompt_token_ids=[3, 4, 5],
                sampling=_sampling(COSTLY_TO_SEARCH, 4)), timeout=300)]
            await asyncio.to_thread(prober.join, 60)
            await leak_check(p, d)
            return prober.answers, chunks, d.load_proto()
    answers, chunks, load = asyncio.run(body())
    assert answers == {"health": "SERVING", "load": load.worker_id}
    # the search gave up (no max_tokens check): the request ran, and max_tokens cut it
    assert sum(len(c.token_ids) for c in chunks) == 4 and chunks[-1].finish_reason == "length"
    assert (load.num_waiting, load.num_running) == (0, 0)


def test_a_caller_gone_during_the_check_leaves_nothing(tiny_model_dir, monkeypatch) -> None:
    """The check in flight runs to its end (within its budget) and its request is
    dropped: nothing admitted, nothing held, and the worker serves the next one."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            started, ended = await _signal_checks(d, monkeypatch)
            call = ds.Generate(decode_pb2.GenerateRequest(
                request_id="gone", prompt_token_ids=[3, 4, 5],
                sampling=_sampling(COSTLY_TO_SEARCH, 4)))
            reading = asyncio.ensure_future(call.read())
            assert await asyncio.to_thread(started.wait, 60)
            call.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            assert await asyncio.to_thread(ended.wait, 60)
            live = await d.engine.run(lambda e: sorted(e.requests))
            await leak_check(p, d)
            after = [c async for c in ds.Generate(decode_pb2.GenerateRequest(
                request_id="next", prompt_token_ids=[3, 4, 5],
                sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0,
                                                  ignore_eos=True)))]
            for _ in range(100):  # the load is published just after the step's outputs
                if (d.load_proto().num_running, d.load_proto().num_waiting) == (0, 0):
                    break
                await asyncio.sleep(0.05)
            return live, after, d.load_proto()
    live, after, load = asyncio.run(body())
    assert live == [] and sum(len(c.token_ids) for c in after) == 2
    assert (load.num_waiting, load.num_running) == (0, 0)
