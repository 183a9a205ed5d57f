"""Prefill attention over the paged cache, without gathering the context first.

``paged_prefill(q, kv, layer, table, seq_len, params)`` -> [T, Hq, D] for one
sequence's T new tokens (positions seq_len - T .. seq_len - 1, causal over the cached
prefix and themselves; a sliding window and a soft-cap as ``params`` say), or None
where the kernel cannot run it: not on CPU, a quantized cache, the extension not built
(its reason is the ``paged_decode`` fallback: one extension holds both attention
kernels), or ``ENABLED`` off. The caller then takes the gathered SDPA path
(engine/attention/sdpa.py).

On CPU it runs ``torch.ops.tandem.paged_prefill`` (csrc/paged_decode.cpp): K and V are
read once through the block table into panels, then tiles of query rows (the heads of
one KV group side by side) walk the key tiles they can see with an online softmax, in
fp32. bf16 on a CPU with AVX512_BF16 multiplies on bf16 dot products (fp32 sums, the
softmax weights rounded to bf16 for the V products, as torch's SDPA does in bf16);
every other case on fp32 panels and FMAs (``fma_only`` forces those). Each row's
arithmetic depends only on its position and the keys, so a prompt's output is the same
whole, chunked or batched with others.
One layer of the embedded model (9 query heads over 3 KV heads of 64), 2 threads, an
AMD EPYC with AVX-512 BF16 (bf16 GEMM peak about 425 GFLOP/s, fp32 FMA 190), best of 5
(``bench/prefill_attention.py``), kernel against gather + torch SDPA:

    prompt tokens   bf16 (dot products)         bf16 on fp32 panels       fp32
    128              0.21 vs 0.56 ms (2.68x)     0.24 vs 0.41 (1.69x)      0.24 vs 0.36 (1.48x)
    512              1.53 vs 4.59 ms (2.99x)     2.30 vs 4.51 (1.96x)      2.31 vs 4.11 (1.78x)
    2048            19.86 vs 42.53 ms (2.14x)   30.87 vs 42.35 (1.37x)    31.30 vs 41.00 (1.31x)

Under the avx2 ceiling (fp32, the dtype an AVX2-only CPU runs): 0.23 vs 0.36, 2.35 vs
4.16 and 34.65 vs 39.04 ms.
"""
from __future__ import annotations

import torch

from engine.attention.base import LayerAttention
from engine.attention.paged_decode import kernel_unavailable

ENABLED = True
"""False: every prefill takes the gathered SDPA path (tests compare the two)."""


def paged_prefill(q: torch.Tensor, kv: torch.Tensor, layer: int, table: torch.Tensor,
                  seq_len: int, params: LayerAttention, kv_quant: str | None = None,
                  fma_only: bool = False) -> torch.Tensor | None:
    """q [T, Hq, D] (the sequence's new tokens); kv the whole cache; table [B] long, the
    sequence's block table (entries before the window's first block are never read)
    -> [T, Hq, D] in q's dtype, or None (module docstring). fma_only: bf16 on fp32
    panels even where the CPU has bf16 dot products (tests and the benchmark compare)."""
    if (not ENABLED or kv.device.type != "cpu" or kv_quant is not None
            or q.dtype != kv.dtype or kernel_unavailable() is not None):
        return None
    return torch.ops.tandem.paged_prefill(q.contiguous(), kv, layer, table, seq_len,
                                          params.scale, params.window or 0,
                                          params.softcap or 0.0, fma_only)
