"""Speculative decoding on the decode pool (the prefill pool does not speculate): the
tokens of 50 prompts handed off prefill -> decode equal colocated plain decoding's,
greedy and seeded; a request can opt out over the wire; both workers end leak-free."""
from __future__ import annotations

import asyncio

from tests.services.conftest import disagg, leak_check, sampling, services


def _prompt(i: int) -> list[int]:
    phrase = [(i * 13 + j * 7) % 300 + 3 for j in range(6 + i % 5)]
    return phrase * 4 if i % 2 == 0 else [(i * 31 + j * 17) % 311 + 3 for j in range(24)]


def test_decode_pool_speculates_with_identical_tokens(tiny_model_dir, reference) -> None:
    spec = {"speculative_method": "ngram", "speculative_max_batch": 0}

    async def body():
        async with services(tiny_model_dir, decode_engine=spec, kv_blocks=256) as (p, d, ps, ds):
            prompts = [_prompt(i) for i in range(50)]
            params = [sampling(24) if i % 3 else sampling(24, temperature=0.9, seed=i)
                      for i in range(50)]
            got = await asyncio.gather(*(disagg(ps, ds, f"s{i}", pr, sp) for i, (pr, sp)
                                         in enumerate(zip(prompts, params))))
            for i, ((toks, _), pr) in enumerate(zip(got, prompts)):
                want = (reference(pr, 24) if i % 3 else
                        reference(pr, 24, temperature=0.9, seed=i))
                assert toks == want, i
            m = d.metrics  # the engine thread's counters, as /metrics exports them

            def count(metric) -> float:
                return m.labelled(metric, proposer="ngram")._value.get()
            assert count(m.spec_accepted) > 0
            # each request's last chunk says what it proposed and had accepted: together
            # exactly the worker's counters
            lasts = [chunks[-1] for _, chunks in got]
            assert sum(c.spec.proposed_tokens for c in lasts) == count(m.spec_proposed)
            assert sum(c.spec.accepted_tokens for c in lasts) == count(m.spec_accepted)
            assert sum(c.spec.verifications for c in lasts) == count(m.spec_drafts)
            assert all(c.spec.accepted_tokens <= c.spec.proposed_tokens for c in lasts)
            assert p.metrics.labelled(p.metrics.spec_drafts, proposer="ngram")._value.get() == 0
            seen = count(m.spec_drafts)
            _, chunks = await disagg(ps, ds, "off", prompts[0], sampling(24, speculate=False))
            assert count(m.spec_drafts) == seen
            assert chunks[-1].spec.proposed_tokens == 0
            await leak_check(p, d)
    asyncio.run(body())
