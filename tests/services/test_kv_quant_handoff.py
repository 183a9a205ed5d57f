"""A quantized KV cache across the handoff (--kv-cache-dtype int8 on both pools): exact
colocated output, quantized bytes moved as they are (read from /metrics), and a P/D
mismatch refused at connect time naming kv_cache_dtype."""
from __future__ import annotations

import asyncio
import re

from prometheus_client import generate_latest

from engine.config import EngineConfig
from proto import decode_pb2
from tests.services.conftest import disagg, leak_check, refused_handoff, sampling, services

INT8 = {"dtype": "bfloat16", "kv_cache_dtype": "int8"}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 41 + i * 13) % 290 + 5 for i in range(n)]


def _sample(exposition: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of ``name`` in a Prometheus text exposition."""
    return [(m.group(1), float(m.group(2))) for m in
            re.finditer(rf"^{re.escape(name)}\{{(.*?)\}} (\S+)$", exposition, re.M)]


def _colocated(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    from engine.llm_engine import LLMEngine
    from core.sampling import SamplingParams

    eng = LLMEngine(EngineConfig.from_flat(model=str(model_dir), num_kv_blocks=64, max_model_len=256,
                                           **INT8))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return eng.generate([prompt], params)[0].token_ids


def test_int8_disagg_equals_colocated_and_moves_half_the_bytes_plus_scales(tiny_model_dir) -> None:
    prompt = _prompt(69, 1)  # 5 blocks of 16
    want = _colocated(tiny_model_dir, prompt, 12)

    async def body():
        async with services(tiny_model_dir, prefill_engine=INT8, decode_engine=INT8) as (p, d, ps, ds):
            toks, chunks = await disagg(ps, ds, "q", prompt, sampling(12))
            assert toks == want
            assert (chunks[0].trace.blocks_pulled, chunks[0].trace.fallback) == (
                5, decode_pb2.FALLBACK_REASON_UNSPECIFIED)
            cfg = d.engine.info.model_config
            values = 2 * cfg.num_layers * 16 * cfg.num_kv_heads  # (K/V, layer, token, head) rows
            bf16_block = values * cfg.head_dim * 2
            per_block = bf16_block // 2 + values * 2  # int8 codes + one bf16 scale per row
            text = generate_latest(d.metrics.registry).decode()
            [(_, moved)] = _sample(text, "tandem:kv_transfer_bytes_total")
            [(_, blocks)] = _sample(text, "tandem:kv_transfer_blocks_total")
            assert (blocks, moved) == (5, 5 * per_block)
            assert d.engine.info.block_bytes == per_block
            [(labels, one)] = _sample(text, "tandem:kv_cache_info")
            assert one == 1 and 'kv_cache_dtype="int8"' in labels
            assert 'kv_scale_layout="per_token_head:bfloat16@row_end;block_hadamard"' in labels
            assert _sample(text, "tandem:kv_cache_block_bytes")[0][1] == per_block
            await leak_check(p, d)
    asyncio.run(body())


def test_kv_cache_dtype_mismatch_fails_at_connect_naming_it(tiny_model_dir) -> None:
    async def body():
        async with services(tiny_model_dir, prefill_engine=INT8,
                            decode_engine={"dtype": "bfloat16"}) as (p, d, ps, ds):
            details = await refused_handoff(ps, ds, "m", _prompt(40, 2))
            assert "kv_cache_dtype: local 'bfloat16' != remote 'int8'" in details
            assert "--kv-cache-dtype" in details
            await leak_check(p, d)
    asyncio.run(body())
