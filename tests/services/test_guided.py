"""Constrained decoding across the handoff, in one process on the flat tiny model:
the prefill worker samples the first token under the grammar, the decode worker
rebuilds the matcher from the grammar and the tokens so far and gives exactly the
colocated tokens; a decode stream cut mid-way and resumed as the router's failover
does it gives the same output; workers refuse bad constraints before queueing."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from engine.config import EngineConfig
from core.guided.spec import GuidedSpec
from engine.llm_engine import LLMEngine
from core.tokenizer import Tokenizer
from proto.convert import sampling_from_proto
from proto import common_pb2, decode_pb2, prefill_pb2
from tests.guided_cases import CHOICES, REGEXES, SCHEMAS, assert_matches, assert_valid
from tests.services.conftest import generate, leak_check, services

MAX_TOKENS = 120


def _sp(spec: GuidedSpec, seed: int | None, max_tokens: int = MAX_TOKENS):
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0,
                                   guided=common_pb2.Guided(kind=spec.kind, text=spec.text))
    if seed is not None:
        sp.seed = seed
    return sp


def _prompt(i: int) -> list[int]:
    return [(i * 37 + j * 11) % 300 + 3 for j in range(24)]


@pytest.fixture(scope="module")
def colocated(flat_model_dir):
    eng = LLMEngine(EngineConfig.from_flat(model=str(flat_model_dir), dtype="float32", num_kv_blocks=256,
                                           max_model_len=256))

    def run(cases):
        outs = eng.generate([p for p, _ in cases], [sampling_from_proto(sp) for _, sp in cases])
        return [(o.token_ids, o.finish_reason.value) for o in outs]
    return run


async def _disagg(ps, ds, rid: str, prompt: list[int], sp) -> tuple[list[int], str]:
    r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sp))
    if r.finished:
        return [r.first_token], r.finish_reason
    toks, chunks = await generate(ds, rid, prompt, [r.first_token], sp, r.kv_handle)
    return toks, chunks[-1].finish_reason


def _cases(seeded: bool) -> list[tuple[str, GuidedSpec]]:
    specs = [(n, GuidedSpec.json_schema(s)) for n, s in SCHEMAS.items()]
    specs += [("regex", GuidedSpec("regex", r)) for r in REGEXES]
    return specs + [("choice", GuidedSpec.choice(c)) for c in CHOICES]


@pytest.mark.parametrize("seeded", [False, True])
def test_disaggregated_equals_colocated_and_every_output_is_valid(flat_model_dir, colocated,
                                                                  seeded) -> None:
    cases = _cases(seeded)
    protos = [(_prompt(i), _sp(spec, 40 + i if seeded else None)) for i, (_, spec) in
              enumerate(cases)]
    want = colocated(protos)

    async def body():
        async with services(flat_model_dir, kv_blocks=256) as (p, d, ps, ds):
            got = await asyncio.gather(*[_disagg(ps, ds, f"g{i}", prompt, sp)
                                         for i, (prompt, sp) in enumerate(protos)])
            await leak_check(p, d)
            return got
    got = asyncio.run(body())
    assert got == want
    decode = Tokenizer.load(flat_model_dir).decode
    for (name, spec), (toks, reason) in zip(cases, got):
        assert reason == "stop", (name, decode(toks))
        text = decode(toks)
        if name == "regex":
            assert_matches(spec.text, text)
        elif name == "choice":
            assert text in json.loads(spec.text)
        else:
            assert_valid(name, text)


def test_decode_failover_mid_stream_rebuilds_the_grammar(flat_model_dir, colocated) -> None:
    """The router's failover: a decode stream that dies after k tokens is re-prefilled
    with those tokens (a new attempt id) and continued on a decode worker; both workers
    replay them through the grammar, and the seeded output is the uninterrupted one."""
    spec = GuidedSpec.json_schema(SCHEMAS["nested_object"])
    prompt, sp = _prompt(3), _sp(spec, 1234)
    [(want, _)] = colocated([(prompt, sp)])

    async def body():
        async with services(flat_model_dir) as (p, d, ps, ds):
            r = await ps.Prefill(prefill_pb2.PrefillRequest(request_id="f-0", token_ids=prompt,
                                                            sampling=sp))
            call = ds.Generate(decode_pb2.GenerateRequest(
                request_id="f-0", prompt_token_ids=prompt, output_token_ids=[r.first_token],
                sampling=sp, kv_handle=r.kv_handle))
            got = [r.first_token]
            async for chunk in call:
                got += list(chunk.token_ids)
                if len(got) >= 12:
                    call.cancel()  # the worker is gone, as far as the router can tell
                    break
            r2 = await ps.Prefill(prefill_pb2.PrefillRequest(
                request_id="f-1", token_ids=prompt, output_token_ids=got, sampling=sp))
            toks, chunks = await generate(ds, "f-1", prompt, got + [r2.first_token], sp,
                                          r2.kv_handle)
            await leak_check(p, d)
            return toks, chunks[-1].finish_reason
    toks, reason = asyncio.run(body())
    assert (toks, reason) == (want, "stop")


def test_workers_refuse_bad_constraints_before_queueing(flat_model_dir) -> None:
    prompt = _prompt(5)
    digits = _sp(GuidedSpec("regex", "[0-9]+"), None)

    async def refused(call) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return e.value.details()

    async def body():
        async with services(flat_model_dir) as (p, d, ps, ds):
            bad_regex = _sp(GuidedSpec("regex", "(a"), None)
            assert "guided:" in await refused(ps.Prefill(prefill_pb2.PrefillRequest(
                request_id="a", token_ids=prompt, sampling=bad_regex)))
            bad_schema = _sp(GuidedSpec("json_schema", '{"type": 5}'), None)
            assert "guided:" in await refused(generate(ds, "b", prompt, [], bad_schema))
            short = _sp(GuidedSpec.json_schema(SCHEMAS["defs_and_refs"]), None, max_tokens=4)
            assert "max_tokens" in await refused(ps.Prefill(prefill_pb2.PrefillRequest(
                request_id="c", token_ids=prompt, sampling=short)))
            letters = Tokenizer.load(flat_model_dir).encode("x", add_special_tokens=False)
            assert "output_token_ids" in await refused(generate(ds, "e", prompt, letters, digits))
            assert "guided.kind" in await refused(ps.Prefill(prefill_pb2.PrefillRequest(
                request_id="f", token_ids=prompt, sampling=common_pb2.SamplingParams(
                    max_tokens=4, guided=common_pb2.Guided(kind="xml", text="<a/>")))))
            for svc in (p, d):
                assert not svc.engine.load.busy  # nothing was ever queued
            await leak_check(p, d)
    asyncio.run(body())
