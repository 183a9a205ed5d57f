"""Every supported family against transformers on a small random checkpoint of its own
(tests/models/families.py), fp32 on both sides, --quantization none (the HF checkpoint's
weights as stored, which auto also keeps): greedy continuations equal transformers'
``generate`` token for token, last-position logits agree within 1e-4, and requests
batched together get the tokens each gets alone. One engine per family."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.models.families import (FAMILIES, hf_greedy, load_reference, prompts,
                                   worst_last_logit_gap)

NEW_TOKENS = 32
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, checkpoint):
    """(name, engine, transformers' model) for one family."""
    name = request.param
    path = checkpoint(name)
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=512, block_size=8, attention_backend=FAMILIES[name].backend))
    return name, eng, load_reference(path)


def test_greedy_matches_transformers(family) -> None:
    """8 prompts of 3-60 tokens (most beyond a sliding window of 16) run as one batch,
    32 new tokens each: every token equals transformers'."""
    name, eng, ref = family
    batch = prompts(8, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [c.token_ids for c in eng.generate(batch, params)]
    theirs = [hf_greedy(ref, ids, NEW_TOKENS) for ids in batch]
    diverged = [(i, len(p), next(j for j, (a, b) in enumerate(zip(o, t)) if a != b))
                for i, (p, o, t) in enumerate(zip(batch, ours, theirs)) if o != t]
    assert not diverged, f"{name}: (prompt, its length, first differing token): {diverged}"
    eng.leak_check()


def test_last_logits_match_transformers(family) -> None:
    name, eng, ref = family
    worst = worst_last_logit_gap(eng, ref, prompts(4, seed=2, low=20, high=60))
    assert worst <= LOGIT_ATOL, f"{name}: last-position logits differ by {worst:.2e}"
    eng.leak_check()


def test_concurrent_requests_equal_alone(family) -> None:
    """16 requests at once (chunked prefill and mixed prefill/decode steps among them)
    produce exactly the tokens each produces alone."""
    name, eng, _ = family
    batch = prompts(16, seed=3, low=2, high=40)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    together = [c.token_ids for c in eng.generate(batch, params)]
    alone = [eng.generate([ids], params)[0].token_ids for ids in batch]
    assert together == alone, name
    eng.leak_check()


def test_one_graph_decode_steps_equal_eager(family, checkpoint) -> None:
    """Batch-1 decode steps compiled as one graph (engine/compile/decode.py: every layer's
    attention, sliding window, soft-cap, q/k norms and KV write inside it) give the eager
    engine's tokens. The MoE families' experts cannot compile: they run eagerly."""
    name, eng, _ = family
    compiled = LLMEngine(EngineConfig.from_flat(
        model=str(checkpoint(name)), dtype="float32", quantization="none", max_model_len=256,
        num_kv_blocks=512, block_size=8, attention_backend=FAMILIES[name].backend,
        compile=True, compile_max_batch=1, compile_graph_max_batch=1))
    c = compiled.runner.compiled
    if c.disabled is not None:
        assert name in ("mixtral", "qwen3_moe"), c.disabled
        return
    assert c.layer_groups(1) is not None, name
    c.slower.clear()  # the graph whatever start-up's timing said
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for ids in prompts(2, seed=4, low=10, high=40):
        want = eng.generate([ids], params)[0].token_ids
        assert compiled.generate([ids], params)[0].token_ids == want, name
    assert c.graph_failed is None, c.graph_failed
    compiled.leak_check()
