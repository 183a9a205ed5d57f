"""Bounded KV across the P/D handoff, in one process on a tiny fp32 model whose attention
is sharp enough that the kept set changes the tokens: the prefill side runs the prompt
under the request's kv_policy, so the handle lists only its kept blocks (and, under
h2o, its scores); the decode side adopts them under the same policy and continues.
Disaggregated tokens equal colocated ones exactly under full, streaming and h2o, for
prompts longer than the budget (one ending mid-block, one on a block boundary, where
the decode side's first step drops a block); the blocks pulled are the kept ones, not
the prompt's; a decode request under another policy is refused naming
kv_handle.kv_policy; under a server-wide --kv-policy, pools of one budget serve a
longer prompt on both sides; nothing is left leased or held on either side."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import common_pb2, decode_pb2, prefill_pb2
from tests.services.conftest import generate_after, leak_check, sampling, services
from tests.utils import make_tiny_llama

SERVER = {"allow_request_kv_policy": True, "max_model_len": 128}
PROMPTS = {"mid-block": [(i * 37) % 300 + 3 for i in range(70)],
           "on-boundary": [(i * 53) % 300 + 5 for i in range(64)]}
# (kv_policy, blocks pulled for the 70- and the 64-token prompt): full pulls every block;
# streaming 4+44 keeps its sink block and the newest two (the query at 69: blocks 0, 3, 4;
# at 63: 0, 2, 3); h2o 20+12 keeps 31 tokens compacted into 2 blocks (with a halflife
# too: the handoff's spec carries it, and the decode side fades the scores it adopts; with
# score=mean the handle carries each slot's arrival as well, which the decode side divides by)
POLICIES = [("", (5, 4)), ("streaming:sinks=4,window=44", (3, 3)),
            ("h2o:heavy=20,recent=12", (2, 2)), ("h2o:heavy=20,recent=12,halflife=6", (2, 2)),
            ("h2o:heavy=20,recent=12,score=mean", (2, 2))]
MAX_TOKENS = 24  # the decode side crosses a block boundary, dropping and re-rotating


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), scale=0.5, embed_scale=1.0)


async def _generate(ds, rid: str, prompt: list[int], policy: str, first=None) -> tuple:
    """(tokens, the first chunk's trace); first: the Prefill reply whose handle to use."""
    return await generate_after(ds, rid, prompt, MAX_TOKENS, first, kv_policy=policy)


async def _prefill(ps, rid: str, prompt: list[int], policy: str):
    return await ps.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, sampling=sampling(MAX_TOKENS), kv_policy=policy))


def test_disaggregated_equals_colocated_under_each_policy(sharp_model) -> None:
    async def body():
        async with services(sharp_model, prefill_engine=SERVER,
                            decode_engine=SERVER) as (p, d, ps, ds):
            got = {}
            for policy, pulled in POLICIES:
                for (name, prompt), blocks in zip(PROMPTS.items(), pulled):
                    rid = f"{policy or 'full'}-{name}"
                    first = await _prefill(ps, rid, prompt, policy)
                    assert first.kv_handle.kv_policy == policy
                    disagg, trace = await _generate(ds, rid, prompt, policy, first)
                    colocated, _ = await _generate(ds, rid + "-colocated", prompt, policy)
                    assert disagg == colocated, (rid, disagg, colocated)
                    assert (trace.blocks_pulled, trace.fallback) == (
                        blocks, decode_pb2.FALLBACK_REASON_UNSPECIFIED), rid
                    got[rid] = disagg
            for name in PROMPTS:  # the policies keep different tokens here, so they differ
                runs = [got[f"{policy or 'full'}-{name}"] for policy, _ in POLICIES]
                assert len({tuple(r) for r in runs}) == len(POLICIES), name
            await leak_check(p, d)
    asyncio.run(body())


def test_kv_made_under_another_policy_is_refused_and_nothing_is_held(sharp_model) -> None:
    async def body():
        async with services(sharp_model, prefill_engine=SERVER,
                            decode_engine=SERVER) as (p, d, ps, ds):
            prompt = PROMPTS["mid-block"]
            for made, asked in (("streaming:sinks=4,window=44", ""),
                                ("", "h2o:heavy=20,recent=12")):
                rid = f"x-{made}-{asked}"
                first = await _prefill(ps, rid, prompt, made)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _generate(ds, rid, prompt, asked, first)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "kv_handle.kv_policy" in e.value.details()
                await ps.Abort(common_pb2.AbortRequest(request_id=rid))  # as the router does
            await leak_check(p, d)
    asyncio.run(body())


def test_workers_whose_pools_hold_only_the_budget_serve_a_longer_prompt(sharp_model) -> None:
    """Under a server-wide --kv-policy a pool of one budget (4 blocks, 64 tokens) is enough
    on both sides for a 70-token prompt (5 blocks in full): the decode worker counts the
    budget, not the prompt, before admitting it (it refused it before as needing 5)."""
    policy = "streaming:sinks=4,window=44"
    server = {"kv_policy": policy, "max_model_len": 128}

    async def body():
        async with services(sharp_model, prefill_engine=server, decode_engine=server,
                            kv_blocks=4) as (p, d, ps, ds):
            prompt = PROMPTS["mid-block"]
            first = await _prefill(ps, "small", prompt, "")
            disagg, trace = await _generate(ds, "small", prompt, "", first)
            colocated, _ = await _generate(ds, "small-colocated", prompt, "")
            await leak_check(p, d)
            return first.kv_handle.kv_policy, disagg, colocated, trace.blocks_pulled

    made, disagg, colocated, pulled = asyncio.run(body())
    assert (made, pulled) == (policy, 3) and disagg == colocated


@pytest.mark.parametrize("policy,scores,arrivals,num_tokens,words", [
    ("h2o:heavy=20,recent=12", 4 * 2 * 3 * 32 - 4, 0, 200, "kv_handle.kv_scores: 764 bytes, "
     "not float32 [2, 3, 32] (768 bytes) as kv_policy h2o:heavy=20,recent=12 needs"),
    ("h2o:heavy=20,recent=12,score=mean", 768, 0, 200, "kv_handle.kv_arrivals: 0 bytes, not "
     "int32 [2, 3, 32] (768 bytes) as kv_policy h2o:heavy=20,recent=12,score=mean needs"),
    ("h2o:heavy=20,recent=12", 768, 768, 200, "kv_handle.kv_arrivals: 768 bytes under "
     "kv_policy h2o:heavy=20,recent=12, which keeps none (only score=mean does)"),
    ("h2o:heavy=20,recent=12,score=mean", 768, 768, 100, "kv_handle.kv_arrivals: token "
     "indices 0..191, outside 0..num_tokens (100)"),
    ("h2o:heavy=20,recent=12,score=mean", 768, 768, 200, None)])
def test_a_handles_scores_and_arrivals_must_fit_the_policy(policy, scores, arrivals,
                                                          num_tokens, words) -> None:
    """The decode side adopts h2o's scores (and under score=mean the arrivals, token indices
    up to the handle's num_tokens) only in the shape its model and policy give, [layers,
    KV heads, budget]; otherwise the reason names the handle's field, and the request is
    left as it was."""
    import torch

    from core.kv.policy import parse_kv_policy
    from core.sampling import SamplingParams
    from decode_svc.kv_policy import adopt_scores
    from engine.request import Request
    from proto import kv_link_pb2

    req = Request("r", [1, 2, 3], SamplingParams(), kv_policy=parse_kv_policy(policy))
    handle = kv_link_pb2.KVHandle(
        num_tokens=num_tokens,
        kv_scores=torch.arange(scores // 4, dtype=torch.float32).numpy().tobytes(),
        kv_arrivals=torch.arange(arrivals // 4, dtype=torch.int32).numpy().tobytes())
    assert adopt_scores(req, handle, layers=2, kv_heads=3) == words
    if words is None:
        assert req.kv_scores.shape == req.kv_arrivals.shape == (2, 3, 32)
        assert req.kv_arrivals.dtype == torch.int32 and int(req.kv_arrivals[1, 2, 31]) == 191
    else:
        assert req.kv_scores is None and req.kv_arrivals is None
