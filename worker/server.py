"""gRPC server scaffolding shared by the workers: health checking (the standard
grpc.health.v1 service, for grpcurl and Kubernetes gRPC probes) and server
reflection, on one grpc.aio server."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from auth.grpc_auth import ServerAuth
from auth.screening import Refusal, screened
from proto import decode_pb2, prefill_pb2
from tracing.rpc import server_interceptors

# KV blocks travel in chunks well under this; prompts of 128k tokens fit too.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse is INVALID_ARGUMENT naming the message type,
    not gRPC's UNKNOWN with a traceback in the log."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        parse = handler.request_deserializer

        def safe(raw: bytes):
            try:
                return parse(raw) if parse is not None else raw
            except Exception as e:  # noqa: BLE001 - DecodeError and kin: the caller's fault
                return Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")
        return screened(handler, safe)


REQUEST_METHODS = tuple(f"/{pb.DESCRIPTOR.services_by_name[svc].full_name}/{method}"
                        for pb, svc, method in ((prefill_pb2, "Prefill", "Prefill"),
                                                (decode_pb2, "Decode", "Generate")))
"""The calls that start a request's work here: traced even without a caller's trace."""


def new_server(auth: ServerAuth) -> grpc.aio.Server:
    """The worker's server; every call but health and reflection must carry the
    cluster secret (auth/grpc_auth.py), a request that does not parse is
    INVALID_ARGUMENT, and while tracing is on an authenticated call of a traced
    request (or one that starts a request) gets a server span (tracing/rpc.py)."""
    interceptors = [MalformedRequests(), auth, *server_interceptors(REQUEST_METHODS)]
    return grpc.aio.server(interceptors=interceptors,
                           options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                    ("grpc.so_reuseport", 0)])


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]
                              ) -> health.HealthServicer:
    """Register health (every service SERVING) and reflection; returns the health
    servicer so a draining worker can flip to NOT_SERVING."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in service_names + [""]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                         reflection.SERVICE_NAME], server)
    return servicer


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind insecure on host:port; returns the port (0 picks one). A port in use is
    an error naming --port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"--port {port}: cannot bind {host}:{port} (in use?)")
    return bound
