"""Bounded KV policies over an int8 KV cache (--kv-cache-dtype int8): dropping a block
re-rotates the kept keys through their codes (dequantized, rotated, quantized again:
engine/kv_cache/shift.py), h2o's compaction moves whole rows, codes and scale, and its
scores come from the decode kernel's int8 path and the gathered decode path alike.
Each policy's int8 tokens agree on both paths (logprobs and scores to a code's
rounding), equal the fp32 cache's tokens over a short run (the codes' rounding flips a
greedy token of this sharp model only later), and hold the budget's blocks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.sampling import SamplingParams
from tests.engine.test_kv_policy import GREEDY, _engine, _held
from tests.utils import make_tiny_llama

PROMPT = [(7 * j + 3) % 300 + 1 for j in range(26)]  # past the budget: it drops or evicts
STEPS = 16
AS_FP32 = 11
"""Tokens the int8 cache must give exactly as the fp32 cache does (h2o's first differs at
token 12, streaming's at 15)."""
CODE_ROUNDING = 1e-2
"""The kernel folds each row's scale into its scores, gathering dequantizes first: a K or
V row computed from either may round one int8 code apart, which moves a logprob (and an
accumulated score) by about 1e-3."""


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), scale=0.5, embed_scale=1.0)


def _run(eng, policy: str) -> tuple[list[int], list[float], set[int], torch.Tensor | None]:
    """One request under ``policy``: its tokens, their logprobs, the blocks held at every
    step but the last, and its h2o scores at the end."""
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=STEPS, logprobs=0, **GREEDY),
                          kv_policy=policy)
    req = eng.requests[rid]
    toks, lps, held = [], [], set()
    while eng.has_unfinished():
        for out in eng.step():
            toks += out.new_token_ids
            lps += [lp.logprob for lp in out.logprobs]
            if not out.finished:
                held.add(_held(eng))
    eng.leak_check()
    return toks, lps, held, req.kv_scores


@pytest.mark.parametrize("policy", ["streaming:sinks=4,window=12", "h2o:heavy=6,recent=10"])
def test_bounded_policies_over_an_int8_cache(sharp_model, policy, monkeypatch) -> None:
    import engine.attention.paged_decode as paged

    def engine(dtype: str):
        return _engine(sharp_model, block_size=4, kv_cache_dtype=dtype, max_model_len=128,
                       kv_policy=policy)

    fp32 = _run(engine("auto"), policy)
    kernel = _run(engine("int8"), policy)
    monkeypatch.setattr(paged, "KERNEL_MAX_ROWS", 0)  # decode rows take the gathered path
    gathered = _run(engine("int8"), policy)
    assert kernel[0][:AS_FP32] == fp32[0][:AS_FP32]
    assert gathered[0] == kernel[0]
    assert gathered[1] == pytest.approx(kernel[1], abs=CODE_ROUNDING)
    if "h2o" in policy:  # the scores eviction chose by agree, not only the tokens
        torch.testing.assert_close(gathered[3], kernel[3], atol=CODE_ROUNDING, rtol=0)
    for run in (fp32, kernel, gathered):
        assert run[2] == {4}  # the budget's 4 blocks of 4 tokens, from the first step on
