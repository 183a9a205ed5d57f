"""The KV ownership handoff between prefill_svc and decode_svc (docs/architecture.md), in one
process on the tiny model: exact tokens, exact bytes, fallbacks, leak checks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvtransfer.lease import ReleaseReason
from kvtransfer.link import KVLinkClient
from proto import common_pb2, decode_pb2, prefill_pb2
from tests.services.conftest import (disagg, generate, leak_check, refused_handoff, sampling,
                                     services)

def run(coro):
    return asyncio.run(coro)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 37 + i * 11) % 300 + 3 for i in range(n)]


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_disagg_equals_colocated_and_moves_only_missing_blocks(tiny_model_dir, reference,
                                                               backend: str) -> None:
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")

    async def body():
        async with services(tiny_model_dir, backend) as (p, d, ps, ds):
            bb = d.engine.info.block_bytes
            shared = _prompt(48, seed=1)  # exactly 3 blocks
            a, b = shared + _prompt(21, 2), shared + _prompt(30, 3)
            toks_a, chunks_a = await disagg(ps, ds, "a", a, sampling())
            assert toks_a == reference(a)
            t = chunks_a[0].trace
            assert (t.blocks_pulled, t.bytes_pulled, t.fallback) == (
                5, 5 * bb, decode_pb2.FALLBACK_REASON_UNSPECIFIED)
            assert t.lease_ended and p.leases.active() == 0  # released, and it says so
            toks_b, chunks_b = await disagg(ps, ds, "b", b, sampling())
            assert toks_b == reference(b)
            t = chunks_b[0].trace
            # the decode worker already holds the 3 shared blocks: only the rest moves
            assert t.local_cached_tokens == 48
            assert (t.blocks_pulled, t.bytes_pulled) == (2, 2 * bb)
            m = d.metrics
            assert m.labelled(m.kv_bytes)._value.get() == 7 * bb
            await leak_check(p, d)
    run(body())


def test_expired_lease_makes_decode_recompute(tiny_model_dir, reference) -> None:
    async def body():
        async with services(tiny_model_dir, lease_ttl_s=0.05) as (p, d, ps, ds):
            prompt = _prompt(40, 4)
            r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id="x", token_ids=prompt,
                                                            sampling=sampling()))
            await asyncio.sleep(0.6)  # the reaper frees the blocks
            assert p.leases.active() == 0
            toks, chunks = await generate(ds, "x", prompt, [r.first_token], sampling(),
                                          r.kv_handle)
            assert chunks[0].trace.fallback in (decode_pb2.FALLBACK_LEASE_EXPIRED,
                                                decode_pb2.FALLBACK_TRANSFER_FAILED)
            assert chunks[0].trace.lease_ended  # the source answered: "expired"
            assert toks == reference(prompt)
            await leak_check(p, d)
    run(body())


def test_compat_mismatch_fails_at_connect_naming_the_field(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir, decode_engine={"block_size": 32}) as (p, d, ps, ds):
            assert "block_size" in await refused_handoff(ps, ds, "m", _prompt(40, 5))
            await leak_check(p, d)  # the abort dropped the prefill side's lease
    run(body())


def test_model_fingerprint_mismatch(tiny_model_dir, tmp_path) -> None:
    from tests.utils import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=7)

    async def body():
        async with services(tiny_model_dir, decode_engine={"model": str(other)}) as (p, d, ps, ds):
            assert "model_fingerprint" in await refused_handoff(ps, ds, "f", _prompt(40, 6))
            await leak_check(p, d)
    run(body())


def test_bad_input_gets_clear_status_and_leaks_nothing(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir, kv_blocks=16) as (p, d, ps, ds):
            # unknown request ids
            assert not (await ps.Abort(common_pb2.AbortRequest(request_id="nope"))).aborted
            assert not (await ds.Abort(common_pb2.AbortRequest(request_id="nope"))).aborted
            # a release for a lease that does not exist
            client = KVLinkClient(f"127.0.0.1:{p.port}", "test", p.secret)
            assert await client.release("ghost", 12345, "no-token") == (False, ReleaseReason.UNKNOWN)
            await client.close()
            # bad sampling values name the field
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ps.Prefill(prefill_pb2.PrefillRequest(
                    request_id="s", token_ids=[5, 6], sampling=sampling(temperature=5)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in e.value.details()
            # a prompt that can never fit (the pool is sized to one context window)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(ds, "big", _prompt(300), [], sampling())
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "context window" in e.value.details()
            # malformed descriptors: block ids the source does not have
            prompt = _prompt(40, 8)
            r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id="bad", token_ids=prompt,
                                                            sampling=sampling()))
            handle = r.kv_handle
            good = list(handle.block_ids)
            del handle.block_ids[:]
            handle.block_ids.extend([9999] * len(good))
            toks, chunks = await generate(ds, "bad", prompt, [r.first_token], sampling(), handle)
            assert chunks[0].trace.fallback != decode_pb2.FALLBACK_REASON_UNSPECIFIED
            assert len(toks) == 8
            await ps.Abort(common_pb2.AbortRequest(request_id="bad"))
            # a handle whose block list does not match its token count
            r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id="short", token_ids=prompt,
                                                            sampling=sampling()))
            del r.kv_handle.block_ids[1:]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(ds, "short", prompt, [r.first_token], sampling(), r.kv_handle)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "kv_handle" in e.value.details()
            await ps.Abort(common_pb2.AbortRequest(request_id="short"))
            await leak_check(p, d)
    run(body())


def test_client_abort_mid_stream_frees_both_sides(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prompt = _prompt(40, 9)
            r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id="c", token_ids=prompt,
                                                            sampling=sampling(200)))
            from proto import decode_pb2
            req = decode_pb2.GenerateRequest(request_id="c", prompt_token_ids=prompt,
                                             output_token_ids=[r.first_token],
                                             sampling=sampling(200), kv_handle=r.kv_handle)
            call = ds.Generate(req)
            async for _ in call:
                break
            call.cancel()
            await asyncio.sleep(0.2)
            await leak_check(p, d)
    run(body())


def test_a_kv_handle_brackets_an_ipv6_advertised_host(tiny_model_dir) -> None:
    """The handle's endpoint is what the decode worker dials: with --advertise-host ::1
    it was '::1:PORT', which gRPC cannot read as host and port."""
    from engine.config import EngineConfig
    from prefill_svc.service import PrefillService
    from worker.config import KVTransferConfig, WorkerConfig

    async def run() -> str:
        p = PrefillService(WorkerConfig(
            engine=EngineConfig.from_flat(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16,
                                          max_model_len=256),
            kv=KVTransferConfig(backend="tcp"), advertise_host="::1"))
        await p.start()
        try:
            from auth.grpc_auth import channel
            from proto import prefill_pb2_grpc
            async with channel(f"127.0.0.1:{p.port}", p.secret) as ch:
                r = await prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                    request_id="v6", token_ids=list(range(5, 45)), sampling=sampling(4)))
            await p.Abort(common_pb2.AbortRequest(request_id="v6"), None)
            await leak_check(p)
            return r.kv_handle.transfer_endpoint, p.port, p.worker_id
        finally:
            await p.stop(0)

    endpoint, port, worker_id = asyncio.run(run())
    assert endpoint == f"[::1]:{port}" and worker_id == f"prefill@[::1]:{port}"
