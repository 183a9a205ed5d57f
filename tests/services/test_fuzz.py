"""Property-based fuzz of every gRPC method of both workers: random and malformed
messages, with the cluster secret and without. No call may end in an unhandled
exception (UNKNOWN, or INTERNAL other than gRPC's own "cannot parse this"), the
workers keep serving, and nothing is held afterwards."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auth.grpc_auth import channel as auth_channel
from proto import common_pb2, decode_pb2, kv_link_pb2, prefill_pb2
from tests.services.conftest import generate, leak_check, sampling, services

METHODS = [  # (service port: "p" | "d", method, request type, streaming reply)
    ("p", "/tandem.prefill.Prefill/Prefill", prefill_pb2.PrefillRequest, False),
    ("p", "/tandem.prefill.Prefill/Abort", common_pb2.AbortRequest, False),
    ("p", "/tandem.prefill.Prefill/GetLoad", common_pb2.LoadRequest, False),
    ("p", "/tandem.prefill.Prefill/StreamKVEvents", common_pb2.KVEventsRequest, True),
    ("p", "/tandem.kvlink.KVLink/Handshake", kv_link_pb2.HandshakeRequest, False),
    ("p", "/tandem.kvlink.KVLink/Release", kv_link_pb2.ReleaseRequest, False),
    ("d", "/tandem.decode.Decode/Generate", decode_pb2.GenerateRequest, True),
    ("d", "/tandem.decode.Decode/Abort", common_pb2.AbortRequest, False),
    ("d", "/tandem.decode.Decode/GetLoad", common_pb2.LoadRequest, False),
    ("d", "/tandem.decode.Decode/StreamKVEvents", common_pb2.KVEventsRequest, True),
    ("d", "/tandem.decode.Decode/SetKVPeers", decode_pb2.KVPeers, False),
    ("p", "/tandem.prefill.Prefill/LoadLoRAAdapter", common_pb2.LoadLoRARequest, False),
    ("d", "/tandem.decode.Decode/UnloadLoRAAdapter", common_pb2.UnloadLoRARequest, False),
]
CLEAN_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.CANCELLED}
_INT = {FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_UINT32: (0, 2**32 - 1),
        FD.TYPE_INT64: (-(2**63), 2**63 - 1), FD.TYPE_UINT64: (0, 2**64 - 1)}


def _scalar(f: FD) -> st.SearchStrategy:
    if f.type in _INT:
        lo, hi = _INT[f.type]
        return st.one_of(st.integers(0, 400), st.integers(lo, hi))
    if f.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type == FD.TYPE_STRING:
        return st.text(max_size=40)
    if f.type == FD.TYPE_BYTES:
        return st.binary(max_size=40)
    if f.type == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    raise AssertionError(f.type)


def messages(cls, depth: int = 0) -> st.SearchStrategy:
    """Any message of this type: each field left out or set to a random value."""
    fields = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type == FD.TYPE_MESSAGE:
            if depth >= 2:
                continue
            sub = messages(_message_class(f), depth + 1)
            value = st.lists(sub, max_size=2) if f.is_repeated else sub
        else:
            value = st.lists(_scalar(f), max_size=50) if f.is_repeated else _scalar(f)
        fields[f.name] = st.one_of(st.none(), value)

    def build(values: dict) -> object:
        msg = cls()
        for name, v in values.items():
            if v is None:
                continue
            target = getattr(msg, name) if not hasattr(v, "SerializeToString") else None
            if isinstance(v, list):
                for item in v:
                    if hasattr(item, "SerializeToString"):
                        getattr(msg, name).add().CopyFrom(item)
                    else:
                        getattr(msg, name).append(item)
            elif target is None:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg
    return st.fixed_dictionaries(fields).map(build)


def _message_class(f: FD):
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(f.message_type)


async def _call(ch, method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    if streaming:
        call = ch.unary_stream(method, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)(payload, timeout=3)
        try:
            async for _ in call:
                break  # one reply is enough: the rest is cancelled (the worker cleans up)
            call.cancel()
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return _clean(e)
    call = ch.unary_unary(method, request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    try:
        await call(payload, timeout=3)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return _clean(e)


def _clean(e: grpc.aio.AioRpcError) -> grpc.StatusCode:
    code = e.code()
    if code == grpc.StatusCode.INTERNAL and "deserializ" in (e.details() or "").lower():
        return grpc.StatusCode.INVALID_ARGUMENT  # gRPC's own: the bytes do not parse
    assert code in CLEAN_CODES, f"{code.name}: {e.details()}"
    return code


@pytest.mark.slow
def test_fuzz_every_method(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir, lease_ttl_s=1.0) as (p, d, ps, ds):
            ports = {"p": p.port, "d": d.port}
            loop = asyncio.get_running_loop()
            authed = {k: auth_channel(f"127.0.0.1:{v}", p.secret) for k, v in ports.items()}
            plain = {k: grpc.aio.insecure_channel(f"127.0.0.1:{v}") for k, v in ports.items()}
            seen: dict[str, set] = {}

            def fuzz(where: str, method: str, cls, streaming: bool) -> None:
                @settings(max_examples=15, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(st.data())
                def one(data) -> None:
                    if data.draw(st.integers(0, 9)) == 0:
                        payload = data.draw(st.binary(max_size=64))  # malformed bytes
                    else:
                        payload = data.draw(messages(cls)).SerializeToString()
                    ch = (plain if data.draw(st.integers(0, 3)) == 3 else authed)[where]
                    code = asyncio.run_coroutine_threadsafe(
                        _call(ch, method, payload, streaming), loop).result(30)
                    seen.setdefault(method, set()).add(code.name)
                one()

            # each method gets its own examples: a draw over all of them once left one out
            for entry in METHODS:
                await loop.run_in_executor(None, fuzz, *entry)
            assert set(seen) == {m for _, m, _, _ in METHODS}, seen
            assert all(codes - {"UNAUTHENTICATED"} for codes in seen.values()), seen  # handlers ran
            toks, _ = await generate(ds, "after-fuzz", [5] * 20, [], sampling())  # still serving
            assert len(toks) == 8
            await asyncio.sleep(1.5)  # leases of fuzzed Prefills expire (ttl 1 s)
            for ch in (*authed.values(), *plain.values()):
                await ch.close()
            await leak_check(p, d)
    asyncio.run(asyncio.wait_for(body(), 300))


def test_a_handshake_naming_two_billion_ranks_is_refused_at_once(tiny_model_dir) -> None:
    """The message the fuzz once drew: a compat record of tensor_parallel_size 2**31 with
    one rank_kv_heads entry. Checking it built a head map of 2**31 entries and took the
    prefill worker to 23 GB (the OOM killer ended the suite); now it is refused."""
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            ch = auth_channel(f"127.0.0.1:{p.port}", p.secret)
            req = kv_link_pb2.HandshakeRequest(reader_id="fuzz", compat=kv_link_pb2.CompatRecord(
                model_fingerprint="m", tensor_parallel_size=2**31, rank_kv_heads=[0]))
            call = ch.unary_unary("/tandem.kvlink.KVLink/Handshake",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "rank_kv_heads: 1 entries cannot be split evenly" in err.value.details()
            await ch.close()
            await leak_check(p, d)
    asyncio.run(asyncio.wait_for(body(), 60))
