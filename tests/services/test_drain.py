"""Graceful termination: a draining worker refuses new work (UNAVAILABLE, health
NOT_SERVING) and lets what runs finish."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.services.conftest import generate, leak_check, sampling, services


def test_drain_finishes_running_and_refuses_new(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            running = asyncio.create_task(generate(ds, "long", [5] * 10, [], sampling(60)))
            while not d.engine.load.busy:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(d.drain(timeout_s=30))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(ds, "new", [6] * 10, [], sampling(4))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in e.value.details()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            toks, chunks = await running
            assert len(toks) == 60 and chunks[-1].finish_reason == "length"
            await asyncio.wait_for(drain, 10)
            await leak_check(p, d)
    asyncio.run(body())
