"""The sliding-window acceptance case: a Mistral checkpoint with a 256-token window
generates 4,000 tokens greedily; at every step each sequence holds at most
window/block_size + 2 blocks of the pool, and the tokens equal transformers' ``generate``.

The checkpoint is the family's small random one (tests/models/families.py) with the window
raised to 256 and ``initializer_range`` 0.2: its greedy continuations stay aperiodic over
4,000 tokens (hundreds of distinct tokens), so the comparison is not one short loop
repeated, and its margins stay far above fp32 summation noise."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.kv_cache.manager import NULL_BLOCK
from engine.llm_engine import LLMEngine
from tests.models.families import build_checkpoint, hf_greedy

WINDOW, BLOCK = 256, 16
BOUND = WINDOW // BLOCK + 2
NEW_TOKENS = 4000
PROMPTS = [list(range(3, 40)), list(range(10, 310))]  # shorter and longer than the window


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is the reference")
    return build_checkpoint(tmp_path_factory.mktemp("mistral-256"), "mistral",
                            sliding_window=WINDOW, max_position_embeddings=4400,
                            initializer_range=0.2)


def _reference(path, **changes):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **changes).eval()


def test_the_reference_applies_the_window(mistral) -> None:
    """transformers' eager and sdpa attention agree on a prompt longer than the window,
    and both apply it: their logits equal the windowless model's before position 256 and
    differ after it (so comparing with transformers tests the window, not a full cache)."""
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        logits = {impl: _reference(mistral, attn_implementation=impl)(ids).logits[0]
                  for impl in ("eager", "sdpa")}
        full = _reference(mistral, sliding_window=None)(ids).logits[0]
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    for got in logits.values():
        torch.testing.assert_close(got[:WINDOW], full[:WINDOW], rtol=1e-5, atol=1e-5)
        assert (got[WINDOW:] - full[WINDOW:]).abs().amax(-1).min() > 1e-3


def test_4000_tokens_hold_the_window_and_equal_transformers(mistral) -> None:
    """Two requests at once in a pool of 48 blocks (one 4,000-token sequence would need
    250 without the window): the blocks each holds, read from its table after every step,
    never exceed window/block_size + 2, and both continuations equal transformers'."""
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(mistral), dtype="float32", quantization="none", max_model_len=4400,
        num_kv_blocks=48, block_size=BLOCK, max_num_batched_tokens=64))
    assert eng.kv.sliding_window == WINDOW
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [eng.requests[eng.add_request(p, params)] for p in PROMPTS]
    most = 0
    while eng.has_unfinished():
        eng.step()
        held = [sum(b != NULL_BLOCK for b in eng.kv.tables.get(r.request_id, ()))
                for r in reqs]
        assert eng.kv.pool.num_blocks - eng.kv.pool.num_free == sum(held)
        most = max(most, *held)
    eng.leak_check()
    assert most == BOUND  # the bound is reached, never passed
    ref = _reference(mistral)
    for prompt, req in zip(PROMPTS, reqs):
        assert len(req.output_token_ids) == NEW_TOKENS
        assert req.output_token_ids == hf_greedy(ref, prompt, NEW_TOKENS), len(prompt)
    # the window matters to these tokens: the windowless model soon says something else
    windowless = hf_greedy(_reference(mistral, sliding_window=None), PROMPTS[0], 600)
    assert windowless != reqs[0].output_token_ids[:600]
