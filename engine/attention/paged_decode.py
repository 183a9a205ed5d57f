"""Decode attention over the paged cache, without gathering the context first.

``paged_decode(q, kv, layer, tables, lens, scale, kv_quant)`` -> [N, Hq, D] for N
sequences with one query token each. On CPU (up to KERNEL_MAX_ROWS sequences: any
batch the engine runs) it runs ``torch.ops.tandem.paged_decode``
(csrc/paged_decode.cpp): K and V rows are read in place through the block tables, one
sequence (or, with few sequences, one range of its tokens) per task, so a step copies
no context; an int8 cache is read as codes, its row scales folded into the scores and
the softmax weights (no dequantized copy). The extension is built on first use with
the machine's compiler (about 20 s, once per source version: engine/native.py).

Above KERNEL_MAX_ROWS, and elsewhere (CUDA, an fp8 cache, or no compiler: said once in
the log), it takes the gathered path: one batched SDPA over the contexts padded to the
longest, a quantized cache dequantized as it is gathered.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.base import gather_blocks
from engine.kv_cache.quant import rotation
from engine.native import NativeKernel

def _register_fakes() -> None:
    torch.library.register_fake("tandem::paged_decode")(
        lambda q, kv, layer, tables, lens, scale: torch.empty_like(q))


KERNEL = NativeKernel("paged_decode", Path(__file__).parent / "csrc" / "paged_decode.cpp",
                      _register_fakes, without="decode attention gathers the context first")
kernel_unavailable = KERNEL.unavailable
build_directory = KERNEL.build_directory


KERNEL_MAX_ROWS = 1 << 16
"""Above this many decode rows the gathered SDPA path runs (tests lower it to force that
path). The tiled kernel wins at every batch measured: one layer, bf16, 2 threads,
kernel vs gathered ms at 160 tokens of context 0.09 vs 0.31 (8 rows), 0.47 vs 1.23
(32), 0.81 vs 1.99 (64); at 2,048 tokens 1.10 vs 2.25 (8), 5.11 vs 13.05 (32), 13.2
vs 65.0 (64). The first kernel lost from about 64 rows, hence a cap of 16 until the
tiles."""


def paged_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, kv_quant: str | None = None) -> torch.Tensor:
    """q [N, Hq, D]; kv the whole cache; tables [N, maxb] long (padded with any block
    id); lens [N] long; kv_quant None (kv in q's dtype) or a quantized --kv-cache-dtype
    -> [N, Hq, D]."""
    if (kv.device.type == "cpu" and q.shape[0] <= KERNEL_MAX_ROWS
            and kv_quant in (None, "int8") and kernel_unavailable() is None):
        return kernel_decode(q, kv, layer, tables, lens, scale, kv_quant)
    return gathered_decode(q, kv, layer, tables, lens, scale, kv_quant)


def kernel_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                  lens: torch.Tensor, scale: float, kv_quant: str | None = None) -> torch.Tensor:
    """The in-place kernel. An int8 cache holds rotated rows (engine/kv_cache/quant.py):
    the kernel gets the rotated query (q . k is unchanged) and its output, a weighted sum
    of rotated values, is rotated back."""
    if kv_quant is None:
        return torch.ops.tandem.paged_decode(q.contiguous(), kv, layer, tables, lens, scale)
    r = rotation(q.shape[-1], q.device)
    qr = (q.float() @ r).to(q.dtype).contiguous()
    out = torch.ops.tandem.paged_decode(qr, kv, layer, tables, lens, scale)
    return (out.float() @ r).to(q.dtype)


def gathered_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, kv_quant: str | None = None
                    ) -> torch.Tensor:
    """The fallback: gather each context (padded to the longest), one batched SDPA with a
    key mask (faster on CPU than an explicit matmul-softmax-matmul over the same gather)."""
    n = q.shape[0]
    ks, vs = gather_blocks(layer, kv, tables.reshape(-1), kv_quant, q.dtype)  # [N*maxb, B, Hkv, D]
    ks = ks.view(n, -1, *ks.shape[-2:]).transpose(1, 2)  # [N, Hkv, S, D]
    vs = vs.view(n, -1, *vs.shape[-2:]).transpose(1, 2)
    keys = torch.arange(ks.shape[2], device=q.device)
    mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [N, 1, 1, S]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [N, Hq, 1, D]
    return out.squeeze(2)
