"""Forged peers against the worker services: calls without the cluster secret or with
another one, handles naming unknown endpoints, guessed and replayed lease tokens, and
a fake prefill server trying to poison a popular prefix. Each is refused, no byte of
KV is read from or into the wrong place, outputs equal the colocated engine's, and
nothing is held afterwards."""
from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
import torch

from auth.grpc_auth import channel as auth_channel
from kvtransfer.base import CompatRecord, get_backend
from kvtransfer.lease import LeaseTable
from kvtransfer.link import KVLinkServicer, add_kv_link
from proto import (common_pb2, decode_pb2, kv_link_pb2, prefill_pb2)
from tests.services.conftest import generate, leak_check, sampling, services

PROMPT = [(i * 7) % 300 + 3 for i in range(40)]


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 120))


async def _prefill(ps, rid: str, prompt=PROMPT):
    return await ps.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt,
                                                       sampling=sampling()), timeout=30)


async def _generate_with(ds, rid: str, first, handle: kv_link_pb2.KVHandle, prompt=PROMPT):
    return await generate(ds, rid, prompt, [first.first_token], sampling(), handle)


@pytest.mark.parametrize("secret", [None, b"another-cluster-secret-value"])
def test_calls_without_the_cluster_secret_are_unauthenticated(tiny_model_dir, secret) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            for port, calls in (
                    (p.port, [("/tandem.prefill.Prefill/Prefill", prefill_pb2.PrefillRequest(
                        request_id="x", token_ids=PROMPT, sampling=sampling())),
                              ("/tandem.prefill.Prefill/GetLoad", common_pb2.LoadRequest()),
                              ("/tandem.kvlink.KVLink/Handshake", kv_link_pb2.HandshakeRequest()),
                              ("/tandem.kvlink.KVLink/Release", kv_link_pb2.ReleaseRequest())]),
                    (d.port, [("/tandem.decode.Decode/GetLoad", common_pb2.LoadRequest()),
                              ("/tandem.decode.Decode/Abort", common_pb2.AbortRequest()),
                              ("/tandem.decode.Decode/SetKVPeers", decode_pb2.KVPeers())])):
                async with (grpc.aio.insecure_channel(f"127.0.0.1:{port}") if secret is None
                            else auth_channel(f"127.0.0.1:{port}", secret)) as ch:
                    for method, msg in calls:
                        call = ch.unary_unary(method, request_serializer=type(msg).SerializeToString,
                                              response_deserializer=lambda b: b)
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            await call(msg, timeout=10)
                        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
                        assert "cluster secret" in e.value.details()
                    for stream in ("/tandem.decode.Decode/Generate",
                                   "/tandem.decode.Decode/StreamKVEvents"):
                        if port != d.port:
                            continue
                        call = ch.unary_stream(stream, request_serializer=lambda m: m,
                                               response_deserializer=lambda b: b)
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            async for _ in call(b"", timeout=10):
                                pass
                        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # the refused Prefill ran nothing and the workers still serve
            toks, _ = await generate(ds, "ok", PROMPT, [], sampling())
            assert len(toks) == 8
            await leak_check(p, d)
    _run(body())


class _Listener:
    """A TCP port that counts who dials it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.dialed = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.dialed += 1
            conn.close()


def test_a_handle_naming_an_unknown_endpoint_is_never_dialed(tiny_model_dir, reference) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            fake = _Listener()
            first = await _prefill(ps, "u")
            handle = kv_link_pb2.KVHandle()
            handle.CopyFrom(first.kv_handle)
            handle.transfer_endpoint = f"127.0.0.1:{fake.port}"
            toks, chunks = await _generate_with(ds, "u", first, handle)
            assert chunks[0].trace.fallback == decode_pb2.FALLBACK_UNKNOWN_PEER
            assert chunks[0].trace.bytes_pulled == 0
            assert not chunks[0].trace.lease_ended and p.leases.active() == 1  # the router's
            assert toks == reference(PROMPT, 8) and fake.dialed == 0
            await ps.Abort(common_pb2.AbortRequest(request_id="u"))
            m = d.metrics
            assert m.labelled(m.kv_fallbacks, reason="unknown_peer")._value.get() == 1
            await leak_check(p, d)
    _run(body())


@pytest.mark.parametrize("forge", ["guessed", "replayed"])
def test_a_guessed_or_replayed_lease_token_reads_nothing(tiny_model_dir, reference, forge) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            first = await _prefill(ps, "t")
            handle = kv_link_pb2.KVHandle()
            handle.CopyFrom(first.kv_handle)
            if forge == "guessed":
                handle.lease_token = "0" * 32
            else:  # a real handoff first: its lease is released, then the handle is replayed
                toks, chunks = await _generate_with(ds, "t", first, first.kv_handle)
                assert chunks[0].trace.blocks_pulled > 0
            toks, chunks = await _generate_with(ds, "t2", first, handle)
            assert chunks[0].trace.bytes_pulled == 0
            assert chunks[0].trace.fallback == decode_pb2.FALLBACK_LEASE_EXPIRED
            # a guessed token ends nothing (the router then aborts); a replayed one's
            # lease had ended already
            assert chunks[0].trace.lease_ended == (forge == "replayed")
            assert toks == reference(PROMPT, 8)
            if forge == "guessed":  # the wrong token could not release the real lease
                assert p.leases.active() == 1
                await ps.Abort(common_pb2.AbortRequest(request_id="t"))
            await leak_check(p, d)
    _run(body())


async def _fake_prefill_server(kv: torch.Tensor, compat: CompatRecord, secret: bytes):
    """A KVLink server with poisoned blocks, the right compat record, but not the
    cluster secret (it answers every call: it has no interceptor)."""
    leases, reads = LeaseTable(), []
    source = get_backend("tcp").source()

    def check(rid, epoch, token, blocks):
        reads.append(rid)
        leases.check_readable(rid, epoch, token, blocks)
    source.register(kv, compat, check)
    source.serve("127.0.0.1")
    server = grpc.aio.server()
    add_kv_link(server, KVLinkServicer(source, leases, lambda lease: None, "prefill@fake", secret))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, source, leases, reads, f"127.0.0.1:{port}"


def test_a_fake_prefill_server_cannot_poison_a_prefix(tiny_model_dir, reference) -> None:
    """It serves wrong blocks for a popular prompt under a lease of its own; the decode
    worker, even told to accept KV from it, finds it cannot prove the cluster secret,
    reads nothing from it, recomputes, and its prefix cache never holds those bytes."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            real = await _prefill(ps, "real")  # for the handle's shape; then dropped
            await ps.Abort(common_pb2.AbortRequest(request_id="real"))
            poison = torch.full_like(p.engine.kv_tensor, 7.0)
            server, source, leases, reads, endpoint = await _fake_prefill_server(
                poison, p.compat(), b"the-attackers-own-secret-value")
            d.kv_peers = replace_peers(d, endpoint)
            lease = leases.grant("victim", list(real.kv_handle.block_ids), 30)
            handle = kv_link_pb2.KVHandle()
            handle.CopyFrom(real.kv_handle)
            handle.transfer_endpoint, handle.lease_epoch = endpoint, lease.epoch
            handle.lease_token, handle.worker_id = lease.token, "prefill@fake"
            toks, chunks = await _generate_with(ds, "victim", real, handle)
            assert chunks[0].trace.fallback == decode_pb2.FALLBACK_UNAUTHENTICATED_PEER
            assert chunks[0].trace.bytes_pulled == 0 and reads == []
            assert toks == reference(PROMPT, 8)
            again, _ = await generate(ds, "again", PROMPT, [], sampling())  # from the cache
            assert again == reference(PROMPT, 8)
            await server.stop(None)
            source.close()
            await leak_check(p, d)
    _run(body())


def replace_peers(d, endpoint: str):
    from decode_svc.peers import KVPeerList

    return KVPeerList(tuple(d.kv_peers.current() | {endpoint}))


def test_different_weights_never_exchange_kv(tiny_model_dir, tmp_path_factory) -> None:
    """Two checkpoints with equal config and equal file sizes but other weights get
    other fingerprints, and the handshake between them is refused naming the field."""
    from tests.utils import make_tiny_llama

    other = make_tiny_llama(tmp_path_factory.mktemp("tiny-other"), seed=1)
    assert sorted(f.stat().st_size for f in other.iterdir()) == \
        sorted(f.stat().st_size for f in tiny_model_dir.iterdir())

    async def body():
        async with services(tiny_model_dir, decode_engine={"model": str(other)}) as (p, d, ps, ds):
            assert p.compat().model_fingerprint != d.compat().model_fingerprint
            first = await _prefill(ps, "f")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _generate_with(ds, "f", first, first.kv_handle)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model_fingerprint" in e.value.details()
            await ps.Abort(common_pb2.AbortRequest(request_id="f"))
            await leak_check(p, d)
    _run(body())
