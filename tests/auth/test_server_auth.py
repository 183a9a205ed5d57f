"""ServerAuth on a real grpc.aio server on 127.0.0.1: a refused request is never
parsed and its handler never runs, whichever binding failed; a client-streaming
method, which no one digest covers, is refused naming why."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from auth.grpc_auth import METADATA_KEY, ServerAuth, channel
from auth.targets import server_names
from auth.tokens import mint
from worker.server import new_server

SECRET = b"server-auth-test-secret-0123456789"
ECHO = "/t.T/Echo"


async def _server(parsed: list[bytes], ran: list[bytes]):
    def parse(raw: bytes) -> bytes:
        parsed.append(raw)
        return raw

    async def echo(request: bytes, context) -> bytes:
        ran.append(request)
        return request

    async def upload(requests, context) -> bytes:
        return b"".join([r async for r in requests])

    auth = ServerAuth(SECRET)
    server = new_server(auth)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parse),
        "Upload": grpc.stream_unary_rpc_method_handler(upload)})])
    port = server.add_insecure_port("127.0.0.1:0")
    auth.answer_to(server_names("127.0.0.1", port, "127.0.0.1"))
    await server.start()
    return server, port


@pytest.mark.parametrize("made_for, body, why", [
    ("127.0.0.1:{other}", b"hello", "made for server 127.0.0.1:{other}"),
    ("127.0.0.1:{port}", b"hullo", "made for another request message"),
])
def test_a_refused_request_is_never_parsed(made_for, body, why) -> None:
    async def run():
        parsed, ran = [], []
        server, port = await _server(parsed, ran)
        ports = {"port": port, "other": port + 1}
        token = mint(SECRET, ECHO, made_for.format(**ports), b"hello")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(ECHO)(body, metadata=((METADATA_KEY, token),), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert why.format(**ports) in e.value.details()
        assert parsed == [] and ran == []
        async with channel(f"127.0.0.1:{port}", SECRET) as ch:  # the right token: parsed once
            assert await ch.unary_unary(ECHO)(b"hello", timeout=10) == b"hello"
        assert parsed == [b"hello"] and ran == [b"hello"]
        await server.stop(None)
    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_client_streaming_method_is_refused() -> None:
    async def run():
        server, port = await _server([], [])
        async with channel(f"127.0.0.1:{port}", SECRET) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.stream_unary("/t.T/Upload")(iter([b"a", b"b"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "client-streaming method cannot be authenticated" in e.value.details()
        await server.stop(None)
    asyncio.run(asyncio.wait_for(run(), 60))
