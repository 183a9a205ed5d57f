"""The cluster secret on gRPC: every call a client makes carries a fresh token
(tokens.py) in the ``tandem-auth`` metadata, bound to the method, the address the
channel dialed and the request message; every server checks it before the handler
runs and answers UNAUTHENTICATED otherwise. Health checking and reflection stay open,
for probes and grpcurl.

Every authenticated RPC of Tandem (proto/*.proto) takes one request message (unary or
server-streaming), so a token covers the whole body; a client-streaming method is
refused, since no one digest could cover its messages."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import grpc

from auth.screening import Refusal, refused, screened
from auth.targets import normalize
from auth.tokens import Verifier, mint

log = logging.getLogger(__name__)

METADATA_KEY = "tandem-auth"
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods any caller may use."""


def _wire_bytes(request: Any) -> bytes:
    """The bytes the call sends: Tandem's stubs (proto/*_pb2_grpc.py) serialize with
    ``request_serializer=Message.SerializeToString``, the same call on the same object
    here, and our messages have no map fields (the one kind whose order protobuf leaves
    open; tests/auth/test_tokens.py checks), so the digest is of exactly what the
    server's deserializer receives. Bytes are a raw call's (tools, tests), whose
    serializer passes them through."""
    if isinstance(request, bytes):
        return request
    return request.SerializeToString()


def token_metadata(secret: bytes, method: str | bytes, target: str, request: Any
                   ) -> tuple[str, str]:
    """The ``tandem-auth`` entry for one call of ``method`` to the normalized ``target``."""
    name = method.decode() if isinstance(method, bytes) else method
    return METADATA_KEY, mint(secret, name, target, _wire_bytes(request))


class _ClientAuth:
    def __init__(self, secret: bytes, target: str) -> None:
        self._secret = secret
        self._target = target

    def _details(self, d: grpc.aio.ClientCallDetails, request) -> grpc.aio.ClientCallDetails:
        md = list(d.metadata or ()) + [token_metadata(self._secret, d.method, self._target,
                                                      request)]
        return d._replace(metadata=grpc.aio.Metadata(*md))


# grpc.aio files each interceptor under the first kind it is (an elif chain), so
# each kind of call gets its own class. Client-streaming calls get no token.
class _UnaryUnary(_ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details, request), request)


class _UnaryStream(_ClientAuth, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details, request), request)


RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250),
                     ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000))
"""gRPC's reconnect backoff grows to 120 s by default: a router started a minute before
its workers (pods come up in any order) saw them 14 s after they served, and could wait
two minutes. Capped at 2 s, a worker that comes up (or back) is seen within a health
period or two."""


def channel(address: str, secret: bytes, options: Sequence[tuple[str, Any]] = (),
            interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """An asyncio channel to a Tandem worker whose calls carry the cluster secret, bound
    to ``address`` as dialed; it retries a worker that is not (yet) listening at least
    every 2 s (RECONNECT_OPTIONS). interceptors: more, run after the secret's
    (tracing's, tracing/rpc.py)."""
    target = normalize(address)
    named = {k for k, _ in options}
    opts = [o for o in RECONNECT_OPTIONS if o[0] not in named] + list(options)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=[
        k(secret, target) for k in (_UnaryUnary, _UnaryStream)] + list(interceptors))


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses a call whose token does not fit it, before its handler runs: on its
    metadata (secret, method, server name, time, replay) before the body is looked at,
    then on the body's digest before the body is parsed."""

    def __init__(self, secret: bytes, worker_id: str = "",
                 names: frozenset[str] = frozenset()) -> None:
        self._verifier = Verifier(secret, names)
        self.worker_id = worker_id

    def answer_to(self, names: frozenset[str]) -> None:
        """The targets clients may dial this server by (targets.server_names): set once
        its port is bound, before it starts. Until then every token is refused."""
        self._verifier.names = names

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if handler.stream_unary or handler.stream_stream:
            return refused(handler, self._refusal(
                method, "a client-streaming method cannot be authenticated (a cluster "
                        "token covers one request message)"))
        token = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), None)
        claims, why = self._verifier.open(token, method)
        if claims is None:
            return refused(handler, self._refusal(method, why))
        parse = handler.request_deserializer

        def screen(raw: bytes):
            why = self._verifier.admit(claims, raw)
            if why is not None:
                return self._refusal(method, why)
            return parse(raw) if parse is not None else raw
        return screened(handler, screen)

    def _refusal(self, method: str, why: str) -> Refusal:
        # why names the failed binding and never holds the token or the secret
        log.warning("%s refused %s: %s", self.worker_id or "worker", method, why)
        return Refusal(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {why}")


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, d: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = d.wait_for_ready, d.compression
        self.metadata = metadata


class _SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: bytes, target: str) -> None:
        self._secret = secret
        self._target = target

    def _details(self, d: grpc.ClientCallDetails, request) -> grpc.ClientCallDetails:
        return _SyncDetails(d, list(d.metadata or ()) + [
            token_metadata(self._secret, d.method, self._target, request)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, request), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, request), request)


def sync_channel(address: str, secret: bytes) -> grpc.Channel:
    """A blocking channel whose calls carry the cluster secret, bound to ``address``
    (tools, tests)."""
    return grpc.intercept_channel(grpc.insecure_channel(address),
                                  _SyncClientAuth(secret, normalize(address)))
