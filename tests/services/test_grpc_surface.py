"""Standard gRPC health checking and server reflection on both workers, so
grpcurl and Kubernetes gRPC probes work."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.services.conftest import services


def test_health_and_reflection(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, _, _):
            for port, svc in ((p.port, "tandem.prefill.Prefill"), (d.port, "tandem.decode.Decode")):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    health = health_pb2_grpc.HealthStub(ch)
                    for name in ("", svc):
                        r = await health.Check(health_pb2.HealthCheckRequest(service=name))
                        assert r.status == health_pb2.HealthCheckResponse.SERVING
                    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                    req = reflection_pb2.ServerReflectionRequest(list_services="")
                    async for reply in refl.ServerReflectionInfo(iter([req])):
                        names = {s.name for s in reply.list_services_response.service}
                        break
                    assert svc in names and "grpc.health.v1.Health" in names
                    if svc.endswith("Prefill"):
                        assert "tandem.kvlink.KVLink" in names
    asyncio.run(body())
