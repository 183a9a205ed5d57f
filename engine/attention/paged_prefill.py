"""Prefill attention over the paged cache, without gathering the context first.

``paged_prefill(q, kv, layer, table, seq_len, params)`` -> [T, Hq, D] for one
sequence's T new tokens (positions seq_len - T .. seq_len - 1, causal over the cached
prefix and themselves; a sliding window and a soft-cap as ``params`` say), or None
where the kernel cannot run it: not on CPU, a quantized cache, the extension not built
(its reason is the ``paged_decode`` fallback: one extension holds both attention
kernels), or ``ENABLED`` off. The caller then takes the gathered SDPA path
(engine/attention/sdpa.py).

On CPU it runs ``torch.ops.tandem.paged_prefill`` (csrc/paged_decode.cpp): K and V are
read once through the block table into fp32 panels, then tiles of query rows (the heads
of one KV group side by side) walk the key tiles they can see with an online softmax,
in fp32 whatever the dtype. Each row's arithmetic depends only on its position and the
keys, so a prompt's output is the same whole, chunked or batched with others.
One layer of the embedded model (9 query heads over 3 KV heads of 64), 2 threads, an
AMD EPYC with AVX-512 (fp32 FMA peak about 190 GFLOP/s), best of 5
(``bench/prefill_attention.py``):

    prompt tokens   bf16: kernel vs gather + torch SDPA    fp32
    128                   0.23 vs 0.40 ms (1.73x)          0.24 vs 0.36 ms (1.50x)
    512                   2.22 vs 4.32 ms (1.94x)          2.26 vs 4.05 ms (1.80x)
    2048                 30.82 vs 40.52 ms (1.31x)        31.42 vs 39.22 ms (1.25x)

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
                  seq_len: int, params: LayerAttention, kv_quant: str | None = None
                  ) -> torch.Tensor | None:
    """q [T, Hq, D] (the sequence's new tokens); kv the whole cache; table [B] long, the
    sequence's block table (entries before the window's first block are never read)
    -> [T, Hq, D] in q's dtype, or None (module docstring)."""
    if (not ENABLED or kv.device.type != "cpu" or kv_quant is not None
            or q.dtype != kv.dtype or kernel_unavailable() is not None):
        return None
    return torch.ops.tandem.paged_prefill(q.contiguous(), kv, layer, table, seq_len,
                                          params.scale, params.window or 0,
                                          params.softcap or 0.0)
