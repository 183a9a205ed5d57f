"""Continuous batching and prefix caching on the real SmolLM2 weights (fp32)."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from core.sampling import SamplingParams

pytestmark = pytest.mark.slow

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches in the old town square near the river").split()


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 3) % len(WORDS):] + WORDS[: i + 1]) * (1 + i % 3)
            for i in range(n)]


@pytest.fixture(scope="module")
def engine(model_path) -> LLMEngine:
    eng = LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", num_kv_blocks=600,
                                           max_num_batched_tokens=64, max_model_len=1024))
    yield eng
    eng.leak_check()


def _run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, params)]


@pytest.mark.parametrize("chunked", [True, False])
def test_batched_equals_alone(engine: LLMEngine, chunked: bool) -> None:
    engine.scheduler.chunked = chunked
    engine.scheduler.budget = 64 if chunked else 512
    engine.kv.pool.reset_prefix_cache()
    prompts = _prompts(16)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = _run(engine, prompts, params)
    engine.leak_check()
    alone = [_run(engine, [p], params)[0] for p in prompts]
    assert together == alone
    engine.leak_check()
    engine.scheduler.chunked, engine.scheduler.budget = True, 64


def test_seeded_sampling_independent_of_batch(engine: LLMEngine) -> None:
    prompts = _prompts(6)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _run(engine, [prompts[0]], seeded)[0]
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True)
              for s in (1, 2)] + [SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)]
    mixed = engine.generate([prompts[3], prompts[1], prompts[0], prompts[5]],
                            [others[0], others[1], seeded, others[2]])
    assert mixed[2].token_ids == alone
    engine.leak_check()


def test_prefix_cache_computes_only_suffix(engine: LLMEngine) -> None:
    engine.kv.pool.reset_prefix_cache()
    bs = engine.config.cache.block_size
    prefix = engine.tokenizer.encode(" ".join(WORDS * 3))[: 3 * bs]
    first = prefix + engine.tokenizer.encode(" and then it rained")
    second = prefix + engine.tokenizer.encode(" but nobody noticed at all")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    _run(engine, [first], params)
    before = engine.num_computed_tokens_total
    warm = engine.generate([second], params)[0]
    computed = engine.num_computed_tokens_total - before
    # only the suffix is prefilled; each decode step computes one more token
    assert computed == (len(second) - 3 * bs) + (8 - 1)
    assert warm.num_cached_tokens == 3 * bs
    engine.kv.pool.reset_prefix_cache()
    cold = engine.generate([second], params)[0]
    assert cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    engine.leak_check()


def test_abort_frees_blocks_and_others_continue(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = engine.add_request(_prompts(2)[0], params)
    b = engine.add_request(_prompts(2)[1], params)
    engine.step()
    out = engine.abort(a)
    assert out.finished and out.finish_reason.value == "abort"
    assert engine.abort("no-such-id") is None
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [b]
    engine.leak_check()


def test_batched_equals_alone_gguf_packed(model_path) -> None:
    """The GGUF kept packed: alone, decode rows run on the int4/int8 kernels; 16 together
    run on the dense copy of the same values. Tokens must not depend on which."""
    if model_path.is_dir():
        pytest.skip("needs the GGUF")
    eng = LLMEngine(EngineConfig.from_flat(model=str(model_path), dtype="float32", num_kv_blocks=600,
                                           max_num_batched_tokens=64, max_model_len=1024,
                                           quantization="gguf", quant_packed_max_rows=4))
    prompts = _prompts(16)
    # 8 tokens: alone, every decode step runs the fp32 int kernels (no vectorised path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = _run(eng, prompts, params)
    alone = [_run(eng, [p], params)[0] for p in prompts]
    assert together == alone
    eng.leak_check()
