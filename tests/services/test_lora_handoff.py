"""LoRA adapters across the P/D handoff, in one process on the tiny model: the
handle carries the adapter's identity, so disaggregated equals colocated under an
adapter; a decode worker refuses KV made under another adapter (or the base), and
nothing is left held; a prefix cached under one adapter is no hit under another; an
unload answers once the requests that use the adapter have finished, and refuses the
next one naming model. Exact tokens and block counts, leak checks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import common_pb2, decode_pb2, prefill_pb2
from tests.models.adapters import tiny_adapters
from tests.services.conftest import generate_after, leak_check, sampling, services

pytest.importorskip("peft", reason="PEFT makes the adapters")

PROMPT = [(i * 13) % 300 + 3 for i in range(50)]  # 3 full blocks of 16 + 2 tokens


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return tiny_adapters(tiny_model_dir, tmp_path_factory.mktemp("loras"), {"a": 8, "b": 4})


def _engine(adapters) -> dict:
    return {"lora_modules": (f"a={adapters['a']}", f"b={adapters['b']}"), "max_lora_rank": 8}


async def _prefill(ps, rid: str, lora: str, max_tokens: int = 8):
    return await ps.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=PROMPT, sampling=sampling(max_tokens), lora_name=lora))


async def _generate(ds, rid: str, lora: str, first=None, max_tokens: int = 8):
    """(tokens, first chunk's trace); first: a Prefill reply whose handle to use."""
    return await generate_after(ds, rid, PROMPT, max_tokens, first, lora_name=lora)


def test_disaggregated_equals_colocated_and_no_prefix_crosses_adapters(tiny_model_dir,
                                                                       adapters) -> None:
    async def body():
        async with services(tiny_model_dir, prefill_engine=_engine(adapters),
                            decode_engine=_engine(adapters)) as (p, d, ps, ds):
            first = await _prefill(ps, "a1", "a")
            assert (first.num_cached_tokens, len(first.kv_handle.lora_identity)) == (0, 32)
            disagg, trace = await _generate(ds, "a1", "a", first)
            assert (trace.blocks_pulled, trace.fallback) == (4, decode_pb2.FALLBACK_REASON_UNSPECIFIED)
            colocated, _ = await _generate(ds, "a2", "a")
            base, _ = await _generate(ds, "u1", "")
            other, _ = await _generate(ds, "b1", "b")
            assert disagg == colocated and base != disagg != other  # the adapter counts
            # a prefix cached under a: 48 tokens under a again, none under b or the base
            assert (await _prefill(ps, "a3", "a", 1)).num_cached_tokens == 48
            assert (await _prefill(ps, "b2", "b", 1)).num_cached_tokens == 0
            assert (await _prefill(ps, "u2", "", 1)).num_cached_tokens == 0
            await leak_check(p, d)
    asyncio.run(body())


def test_kv_made_under_another_adapter_is_refused_and_nothing_is_held(tiny_model_dir,
                                                                      adapters) -> None:
    async def body():
        async with services(tiny_model_dir, prefill_engine=_engine(adapters),
                            decode_engine=_engine(adapters)) as (p, d, ps, ds):
            for made, asked in (("a", "b"), ("a", ""), ("", "a")):
                first = await _prefill(ps, f"x-{made}-{asked}", made)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _generate(ds, f"x-{made}-{asked}", asked, first)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert e.value.details().startswith("kv_handle.lora_identity: the KV was "
                                                    "computed under ")
                assert ("the base model" in e.value.details()) == (made == "" or asked == "")
                await ps.Abort(common_pb2.AbortRequest(request_id=f"x-{made}-{asked}"))
            await leak_check(p, d)
    asyncio.run(body())


def test_unload_waits_for_the_adapters_requests_then_refuses_new_ones(tiny_model_dir,
                                                                      adapters) -> None:
    async def body():
        async with services(tiny_model_dir, decode_engine={"enable_lora": True,
                                                           "max_lora_rank": 8}) as (p, d, ps, ds):
            loaded = await ds.LoadLoRAAdapter(common_pb2.LoadLoRARequest(
                lora_name="late", lora_path=str(adapters["a"])))
            assert [a.name for a in (await ds.GetLoad(common_pb2.LoadRequest())).loras] == ["late"]
            alone, _ = await _generate(ds, "alone", "late", max_tokens=48)
            order: list[str] = []
            req = decode_pb2.GenerateRequest(request_id="long", prompt_token_ids=PROMPT,
                                             sampling=sampling(48), lora_name="late")
            stream = ds.Generate(req)
            toks = list((await stream.read()).token_ids)  # it runs under the adapter now

            async def finish():
                async for c in stream:
                    toks.extend(c.token_ids)
                order.append("stream ended")
            rest = asyncio.ensure_future(finish())
            reply = await ds.UnloadLoRAAdapter(common_pb2.UnloadLoRARequest(lora_name="late"))
            order.append("unloaded")
            await rest
            assert order == ["stream ended", "unloaded"] and toks == alone
            assert reply.adapter.identity == loaded.adapter.identity
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _generate(ds, "after", "late")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("model: no base model or LoRA adapter named 'late'")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ps.LoadLoRAAdapter(common_pb2.LoadLoRARequest(lora_name="x", lora_path="/"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # no --enable-lora
            await leak_check(p, d)
    asyncio.run(body())
