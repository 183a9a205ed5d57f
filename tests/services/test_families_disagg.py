"""Every model family through the P/D path, in one process: a prompt prefilled on one
worker and decoded on another (its KV pulled over TCP or NIXL) gets exactly the greedy
tokens a colocated engine gets; and workers serving different architectures, or different
checkpoints of one architecture, refuse each other's KV at connect time, naming the
architecture. One prefill/decode pair per family and backend; the checkpoints are the
small random ones of tests/models/families.py."""
from __future__ import annotations

import asyncio

import pytest

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.models.conftest import checkpoint  # noqa: F401 - the shared checkpoint fixture
from tests.models.families import FAMILIES, build_checkpoint, prompts
from tests.services.conftest import disagg, leak_check, refused_handoff, sampling, services

NEW_TOKENS = 12
BLOCK = 8


def _engine_flags(family: str) -> dict:
    return {"quantization": "none", "block_size": BLOCK,
            "attention_backend": FAMILIES[family].backend}


@pytest.fixture(scope="module")
def colocated(checkpoint):  # noqa: F811
    """family -> its colocated greedy run (one engine per family, shared by both backends)."""
    engines: dict[str, LLMEngine] = {}

    def run(family: str, prompt: list[int]) -> list[int]:
        if family not in engines:
            engines[family] = LLMEngine(EngineConfig.from_flat(
                model=str(checkpoint(family)), dtype="float32", num_kv_blocks=64,
                max_model_len=256, **_engine_flags(family)))
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        eng = engines[family]
        return eng.generate([prompt], params)[0].token_ids, eng.kv.sliding_window

    return run


def blocks_read(prompt_len: int, window: int | None) -> int:
    """The prompt blocks the decode side reads: all of them, or where every layer slides,
    those the first decode position (prompt_len) sees: prompt_len - window + 1 on."""
    first = 0 if window is None else max(0, prompt_len - window + 1)
    return (prompt_len - 1) // BLOCK - first // BLOCK + 1


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_disagg_equals_colocated(checkpoint, colocated, family: str,  # noqa: F811
                                 backend: str) -> None:
    """Three prompts, one shorter than a block, two beyond the sliding window (16) where
    the family slides: the decode worker pulls the prefilled blocks it will read (all of
    them, or only the window's where every layer slides) and continues."""
    if backend == "nixl":
        pytest.importorskip("nixl_cu12", reason="nixl_cu12 is not installed")
    batch = [p for p in prompts(3, seed=5, low=5, high=40)]
    path = checkpoint(family)

    async def body():
        async with services(path, backend, prefill_engine=_engine_flags(family),
                            decode_engine=_engine_flags(family)) as (p, d, ps, ds):
            for i, prompt in enumerate(batch):
                toks, chunks = await disagg(ps, ds, f"{family}-{i}", prompt,
                                            sampling(NEW_TOKENS))
                want, window = colocated(family, prompt)
                assert toks == want, (family, backend, len(prompt))
                assert chunks[0].trace.blocks_pulled == blocks_read(len(prompt), window)
            await leak_check(p, d)
    asyncio.run(body())


@pytest.mark.parametrize("other", ["qwen2", "llama-seed7"])
def test_handoff_between_models_is_refused_naming_the_architecture(
        checkpoint, tmp_path, other: str) -> None:  # noqa: F811
    """A Llama prefill worker and a decode worker serving Qwen2 (the same KV shapes: only
    the model differs), or another Llama checkpoint: the decode worker refuses the KV at
    connect time, and the reason names the field and both sides' architectures."""
    decode_model = (checkpoint("qwen2") if other == "qwen2"
                    else build_checkpoint(tmp_path / "other", "llama", seed=7))
    flags = _engine_flags("llama")

    async def body():
        async with services(checkpoint("llama"), prefill_engine=flags,
                            decode_engine={**flags, "model": str(decode_model)}) as (p, d, ps, ds):
            why = await refused_handoff(ps, ds, "x", prompts(1, seed=6, low=20, high=20)[0])
            assert "model_fingerprint" in why and "'llama/" in why, why
            if other == "qwen2":
                assert "'qwen2/" in why, why
            await leak_check(p, d)
    asyncio.run(body())
