"""The cluster secret on gRPC: every call a client makes carries a fresh token
(tokens.py) in the ``tandem-auth`` metadata; every server checks it before the
handler runs and answers UNAUTHENTICATED otherwise. Health checking and reflection
stay open, for probes and grpcurl."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import grpc

from auth.tokens import Verifier, mint

log = logging.getLogger(__name__)

METADATA_KEY = "tandem-auth"
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods any caller may use."""


class _ClientAuth:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        md = list(d.metadata or ()) + [(METADATA_KEY, mint(self._secret, method))]
        return d._replace(metadata=grpc.aio.Metadata(*md))


# grpc.aio files each interceptor under the first kind it is (an elif chain), so
# each kind of call gets its own class.
class _UnaryUnary(_ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_ClientAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_ClientAuth, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_ClientAuth, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250),
                     ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000))
"""gRPC's reconnect backoff grows to 120 s by default: a router started a minute before
its workers (pods come up in any order) saw them 14 s after they served, and could wait
two minutes. Capped at 2 s, a worker that comes up (or back) is seen within a health
period or two."""


def channel(address: str, secret: bytes, options: Sequence[tuple[str, Any]] = (),
            interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """An asyncio channel to a Tandem worker whose calls carry the cluster secret; it
    retries a worker that is not (yet) listening at least every 2 s (RECONNECT_OPTIONS).
    interceptors: more, run after the secret's (tracing's, tracing/rpc.py)."""
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    named = {k for k, _ in options}
    opts = [o for o in RECONNECT_OPTIONS if o[0] not in named] + list(options)
    return grpc.aio.insecure_channel(address, options=opts,
                                     interceptors=[k(secret) for k in kinds] + list(interceptors))


def sync_metadata(secret: bytes, method: str) -> list[tuple[str, str]]:
    """Metadata for one call on a blocking (non-aio) channel: stub.M(req, metadata=...)."""
    return [(METADATA_KEY, mint(secret, method))]


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid token before their handler runs."""

    def __init__(self, secret: bytes, worker_id: str = "") -> None:
        self._verifier = Verifier(secret)
        self.worker_id = worker_id

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        token = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), None)
        why = self._verifier.check(token, details.method)
        if why is None:
            return handler
        log.warning("%s refused %s: %s", self.worker_id or "worker", details.method, why)
        return _refusal(handler, f"{details.method}: {why}; every Tandem process of a cluster "
                                 "needs the same cluster secret (--cluster-secret-file)")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # the request is never parsed: an unauthenticated caller learns nothing from it
    kw = dict(request_deserializer=lambda raw: None,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, d: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, d.compression
        self.metadata = metadata


class _SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        return _SyncDetails(d, list(d.metadata or ()) + sync_metadata(self._secret, method))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def sync_channel(address: str, secret: bytes) -> grpc.Channel:
    """A blocking channel whose calls carry the cluster secret (tools, tests)."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _SyncClientAuth(secret))
