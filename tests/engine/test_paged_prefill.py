"""The CPU prefill attention kernel (engine/attention/paged_prefill.py) against the fp32
definition of causal attention over the paged cache, and the invariances it promises."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention.base import LayerAttention, visible
from engine.attention.paged_decode import kernel_unavailable
from engine.attention.paged_prefill import paged_prefill

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"no attention kernel: {kernel_unavailable()}")


def _reference(q, kv, layer, table, slen, params: LayerAttention) -> torch.Tensor:
    """softmax(cap(q.k * scale) | causal, window) v in fp32 from the gathered context."""
    t, bs = q.shape[0], kv.shape[3]
    blocks = table[:-(-slen // bs)]
    k = kv[blocks, layer, 0].reshape(-1, *kv.shape[-2:])[:slen].float()
    v = kv[blocks, layer, 1].reshape(-1, *kv.shape[-2:])[:slen].float()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * params.scale  # [Hq, T, S]
    if params.softcap:
        s = params.softcap * torch.tanh(s / params.softcap)
    seen = visible(torch.arange(slen - t, slen).unsqueeze(1), torch.arange(slen).unsqueeze(0),
                   params.window)
    return (s.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def _cache(rng: random.Random, slen: int, bs: int, hkv: int, d: int, dtype, layers: int = 2):
    """A cache whose sequence's blocks are scattered among others (NaN in every block the
    sequence does not own: a read outside its table shows)."""
    nb = -(-slen // bs)
    kv = torch.full((nb + 4, layers, 2, bs, hkv, d), float("nan"), dtype=dtype)
    ids = list(range(nb + 4))
    rng.shuffle(ids)
    table = torch.tensor(ids[:nb], dtype=torch.long)
    kv[table] = torch.randn(nb, layers, 2, bs, hkv, d, dtype=dtype)
    return kv, table


TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype,fma_only", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 80), (6, 1, 128)])
def test_the_kernel_computes_causal_attention(dtype, fma_only: bool, hq: int, hkv: int,
                                              d: int) -> None:
    """Prompts alone and over a cached prefix, block sizes below, at and above a tile,
    with a sliding window and with a soft-cap: within the output dtype's rounding of the
    fp32 definition. bf16 runs on bf16 dot products where the CPU has them (the softmax
    weights rounded to bf16 for the V products) and on fp32 panels (fma_only)."""
    rng = random.Random(hq * 1000 + d)
    torch.manual_seed(hq * 1000 + d)
    for bs in (1, 16, 32):
        for t, slen in ((1, 1), (7, 7), (33, 33), (20, 70), (100, 100), (5, 200)):
            for window, softcap in ((None, None), (24, None), (None, 30.0)):
                kv, table = _cache(rng, slen, bs, hkv, d, dtype)
                q = torch.randn(t, hq, d, dtype=dtype)
                params = LayerAttention(d ** -0.5, window, softcap)
                out = paged_prefill(q, kv, 1, table, slen, params, fma_only=fma_only)
                ref = _reference(q, kv, 1, table, slen, params)
                err = (out.float() - ref).abs().max().item()
                assert err <= TOL[dtype], (bs, t, slen, window, softcap, err)


def test_blocks_before_the_window_are_never_read() -> None:
    """A window's query chunk never dereferences a table entry wholly before the first
    key it can see (the KV manager may have freed that block: -1 here)."""
    rng = random.Random(3)
    kv, table = _cache(rng, 300, 16, 2, 32, torch.float32)
    q = torch.randn(10, 4, 32)
    params = LayerAttention(0.2, 40, None)
    ref = paged_prefill(q, kv, 0, table, 300, params)
    freed = table.clone()
    freed[:(300 - 10 - 40 + 1) // 16] = -1
    torch.testing.assert_close(paged_prefill(q, kv, 0, freed, 300, params), ref, rtol=0, atol=0)


def test_a_prompt_gives_the_same_bits_whole_or_chunked() -> None:
    """Each row's arithmetic depends only on its position and the keys: a 150-token
    prompt computed whole equals the same prompt computed in chunks of 37, 64 and 49
    over the cached part, bit for bit (torch's SDPA splits queries by length)."""
    rng = random.Random(5)
    torch.manual_seed(5)
    kv, table = _cache(rng, 150, 16, 3, 64, torch.bfloat16)
    q = torch.randn(150, 9, 64, dtype=torch.bfloat16)
    params = LayerAttention(0.125)
    whole = paged_prefill(q, kv, 0, table, 150, params)
    parts, at = [], 0
    for n in (37, 64, 49):
        parts.append(paged_prefill(q[at:at + n], kv, 0, table, at + n, params))
        at += n
    assert torch.equal(torch.cat(parts), whole)


def test_a_bad_table_is_refused_naming_the_block() -> None:
    rng = random.Random(6)
    kv, table = _cache(rng, 40, 16, 1, 16, torch.float32)
    q = torch.randn(4, 2, 16)
    params = LayerAttention(0.25)
    with pytest.raises(RuntimeError, match="the table has no block 2"):
        paged_prefill(q, kv, 0, table[:2], 40, params)
    bad = table.clone()
    bad[1] = kv.shape[0]
    with pytest.raises(RuntimeError, match="block 1 of the table, entry"):
        paged_prefill(q, kv, 0, bad, 40, params)


def test_a_quantized_cache_or_a_mismatched_dtype_takes_the_gathered_path() -> None:
    rng = random.Random(7)
    kv, table = _cache(rng, 16, 16, 1, 16, torch.float32)
    q = torch.randn(4, 2, 16)
    assert paged_prefill(q, kv, 0, table, 16, LayerAttention(0.25), kv_quant="int8") is None
    assert paged_prefill(q.bfloat16(), kv, 0, table, 16, LayerAttention(0.25)) is None


def test_the_benchmark_runs() -> None:
    """bench/prefill_attention.py (README, docs/performance.md) on a short prompt."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "prefill_attention.py"
    out = subprocess.run([sys.executable, str(script), "--lens", "40", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("40 | "), out.stdout
