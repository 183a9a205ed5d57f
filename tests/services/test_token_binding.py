"""Cluster tokens bound to what they authorize, against real workers on 127.0.0.1: a
token taken from a call opens neither another body on its server nor the same call on
another server of the cluster (same secret). Each refusal names the binding that
failed, nothing runs, and the worker keeps serving with nothing held."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest

from auth.grpc_auth import channel as auth_channel
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.services.conftest import leak_check, sampling, services

PROMPT = [(i * 11) % 300 + 3 for i in range(40)]
RPC_TIMEOUT_S = 120  # generous: a first engine step may build a native kernel (~30 s here)


class _Tap(grpc.aio.UnaryUnaryClientInterceptor):
    """The innermost interceptor of an authenticated channel: it sees the token the
    auth interceptor added (what anyone on the wire sees) and, as a man in the middle
    would, may send another message under it."""

    def __init__(self, swap=None) -> None:
        self.tokens: list[str] = []
        self.swap = swap

    async def intercept_unary_unary(self, continuation, details, request):
        self.tokens += [v for k, v in details.metadata if k == "tandem-auth"]
        return await continuation(details, request if self.swap is None else self.swap)


@contextlib.asynccontextmanager
async def _tapped(monkeypatch, address: str, secret: bytes, tap: _Tap):
    """An authenticated channel to address with tap innermost."""
    plain = grpc.aio.insecure_channel
    with monkeypatch.context() as m:
        m.setattr(grpc.aio, "insecure_channel", lambda target, options=None, interceptors=(): plain(
            target, options=options, interceptors=[*interceptors, tap]))
        ch = auth_channel(address, secret)
    async with ch:
        yield ch


async def _replay(port: int, method: str, message, token: str):
    """One call carrying a token taken from another call."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary(method, request_serializer=type(message).SerializeToString,
                              response_deserializer=lambda b: b)
        return await call(message, metadata=(("tandem-auth", token),), timeout=RPC_TIMEOUT_S)


def test_a_token_does_not_open_another_body(tiny_model_dir, monkeypatch) -> None:
    """A router's SetKVPeers, its body swapped in flight to list an attacker's KV source:
    refused, the decode worker's peer list unchanged; the real body under the same
    token still passes (the forgery spent nothing)."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            real = decode_pb2.KVPeers(router_id="r", prefill_endpoints=[f"127.0.0.1:{p.port}"])
            forged = decode_pb2.KVPeers(router_id="r", prefill_endpoints=["127.0.0.1:1"])
            tap = _Tap(swap=forged)
            async with _tapped(monkeypatch, f"127.0.0.1:{d.port}", d.secret, tap) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await decode_pb2_grpc.DecodeStub(ch).SetKVPeers(real, timeout=RPC_TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert e.value.details() == ("/tandem.decode.Decode/SetKVPeers: cluster credentials "
                                         "were made for another request message (sha256 differs)")
            assert "127.0.0.1:1" not in d.kv_peers.current()
            await _replay(d.port, "/tandem.decode.Decode/SetKVPeers", real, tap.tokens[0])
            assert d.kv_peers.current() == {f"127.0.0.1:{p.port}"}
            await leak_check(p, d)
    asyncio.run(asyncio.wait_for(body(), 300))


def test_a_token_does_not_open_another_server(tiny_model_dir, monkeypatch, caplog) -> None:
    """A Prefill taken on its way to one prefill worker and replayed, same body, to
    another of the same cluster: refused there naming both servers and the flag, no
    prefill runs and no lease is held; the same worker dialed as localhost serves."""
    async def body():
        from prefill_svc.service import PrefillService

        async with services(tiny_model_dir) as (p, d, ps, ds):
            q = PrefillService(p.config)  # same model and secret; another port
            await q.start()
            request = prefill_pb2.PrefillRequest(request_id="r1", token_ids=PROMPT,
                                                 sampling=sampling())
            tap = _Tap()
            async with _tapped(monkeypatch, f"127.0.0.1:{p.port}", p.secret, tap) as ch:
                await prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=RPC_TIMEOUT_S)
            with caplog.at_level(logging.WARNING, logger="auth.grpc_auth"), \
                    pytest.raises(grpc.aio.AioRpcError) as e:
                await _replay(q.port, "/tandem.prefill.Prefill/Prefill", request, tap.tokens[0])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            why = (f"cluster credentials were made for server 127.0.0.1:{p.port}, but this "
                   f"server answers to 127.0.0.1:{q.port}, [::1]:{q.port}, localhost:{q.port}; "
                   "start the server with --advertise-host")
            assert why in e.value.details() and why in caplog.text
            assert tap.tokens[0] not in caplog.text
            assert q.leases.active() == 0 and q.engine.load.num_waiting == 0
            async with auth_channel(f"localhost:{q.port}", q.secret) as ch:
                assert (await prefill_pb2_grpc.PrefillStub(ch).GetLoad(
                    common_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)).worker_id == q.worker_id
            await ps.Abort(common_pb2.AbortRequest(request_id="r1"))
            await leak_check(p, d, q)
            await q.stop(0)
    asyncio.run(asyncio.wait_for(body(), 300))
