"""The cache salt across the P/D handoff, in one process on the tiny model: the
prefill worker serves a prompt from its cache only under the salt it was cached with,
and the decode worker adopts its own cached prefix only under that salt too (else it
pulls every block). Exact tokens, exact block counts, leak checks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import decode_pb2, prefill_pb2
from tests.services.conftest import leak_check, sampling, services

NONE = decode_pb2.FALLBACK_REASON_UNSPECIFIED
"""KVTrace.fallback: the KV was pulled."""

SALT_A, SALT_B = b"\xaa" * 32, b"\xbb" * 32


async def _salted(pstub, dstub, rid: str, prompt: list[int], salt: bytes):
    """(tokens, the prefill worker's cached prompt tokens, the decode worker's cached
    prompt tokens, blocks it pulled, its fallback)."""
    sp = sampling()
    first = await pstub.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, sampling=sp, cache_salt=salt))
    req = decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     output_token_ids=[first.first_token], sampling=sp,
                                     cache_salt=salt)
    req.kv_handle.CopyFrom(first.kv_handle)
    toks, chunks = [first.first_token], []
    async for ch in dstub.Generate(req):
        toks += list(ch.token_ids)
        chunks.append(ch)
    t = chunks[0].trace
    return toks, first.num_cached_tokens, t.local_cached_tokens, t.blocks_pulled, t.fallback


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_both_pools_serve_a_prefix_only_under_the_salt_it_was_cached_with(tiny_model_dir,
                                                                         reference) -> None:
    async def body():
        async with services(tiny_model_dir) as (p, d, ps, ds):
            prompt = [(i * 13) % 300 + 3 for i in range(50)]  # 3 full blocks + 2 tokens
            want = reference(prompt)
            assert await _salted(ps, ds, "a1", prompt, SALT_A) == (want, 0, 0, 4, NONE)
            # another tenant: neither worker serves A's blocks; all 4 blocks move
            assert await _salted(ps, ds, "b1", prompt, SALT_B) == (want, 0, 0, 4, NONE)
            # the same tenant: the prefill worker's 3 blocks, the decode worker's own 3
            assert await _salted(ps, ds, "a2", prompt, SALT_A) == (want, 48, 48, 1, NONE)
            # the shared, unsalted cache is apart from both
            assert await _salted(ps, ds, "u1", prompt, b"") == (want, 0, 0, 4, NONE)
            assert await _salted(ps, ds, "u2", prompt, b"") == (want, 48, 48, 1, NONE)
            # a salt no router sends (over 64 bytes): refused naming the field, not held
            for call in (ps.Prefill(prefill_pb2.PrefillRequest(
                    request_id="x1", token_ids=prompt, sampling=sampling(),
                    cache_salt=b"s" * 65)),
                    _drain(ds.Generate(decode_pb2.GenerateRequest(
                        request_id="x2", prompt_token_ids=prompt, sampling=sampling(),
                        cache_salt=b"s" * 65)))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("cache_salt: at most 64 bytes")
            await leak_check(p, d)
    asyncio.run(body())
