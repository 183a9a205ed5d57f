"""Decode attention over the paged cache, without gathering the context first.

``paged_decode(q, kv, layer, tables, lens, scale, kv_quant, window, softcap)`` ->
[N, Hq, D] for N sequences with one query token each (the query at position
lens[i] - 1). With a sliding ``window`` a row sees only its last ``window`` keys:
neither path reads a block wholly before them (the KV manager may have freed it; its
table entry is then never dereferenced). ``softcap`` caps the scaled scores
(softcap * tanh(s / softcap)) before the softmax. On CPU (up to KERNEL_MAX_ROWS
sequences: any batch the engine runs) it runs ``torch.ops.tandem.paged_decode``
(csrc/paged_decode.cpp): K and V rows are read in place through the block tables, one
sequence (or, with few sequences, one range of its tokens) per task, so a step copies
no context; an int8 cache is read as codes, its row scales folded into the scores and
the softmax weights (no dequantized copy). The extension is built on first use with
the machine's compiler (about 20 s, once per source version: engine/native.py).

Above KERNEL_MAX_ROWS, and elsewhere (CUDA, an fp8 cache, or no compiler: said once in
the log), it takes the gathered path: one batched attention over each row's visible
blocks padded to the widest, a quantized cache dequantized as it is gathered.

Scores (h2o): rows with ``score_rows[i] = j >= 0`` leave their scaled (capped) logits
in ``logits[j]`` ([M, Hq, width] fp32, -inf where no key was read), the kernel's own
scores copied out as it computes them; the gathered path computes them explicitly for
those rows only, from the keys it gathered.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.attention.base import (LayerAttention, attention_logits, gather_blocks,
                                   masked_attention, visible)
from engine.attention.metadata import DecodeSlots
from engine.kv_cache.quant import rotation
from engine.native import NativeKernel

def _register_fakes() -> None:
    torch.library.register_fake("tandem::paged_decode")(
        lambda q, kv, layer, tables, lens, scale, window=0, softcap=0.0, score_rows=None,
        logits=None, fma_only=False: torch.empty_like(q))
    torch.library.register_fake("tandem::paged_prefill")(
        lambda q, kv, layer, block_table, seq_len, scale, window=0, softcap=0.0,
        fma_only=False: torch.empty_like(q))
    torch.library.register_fake("tandem::paged_decode_write")(
        lambda q, k, v, kv, slot_blocks, slot_offsets, layer, tables, lens, scale, window=0,
        softcap=0.0, fma_only=False: torch.empty_like(q))


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
tiles. Since the prefetch into L2 spread over a tile's work and the bf16 dot-product
scores, 32 rows at 160 tokens over 30 cold layers take 0.19-0.21 ms a layer in bf16
(0.42 before; ``bench/decode_attention.py``, docs/performance.md)."""


def paged_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, kv_quant: str | None = None,
                 window: int | None = None, softcap: float | None = None,
                 score_rows: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """q [N, Hq, D]; kv the whole cache; tables [N, maxb] long (padded with any block
    id; entries before a row's window are never read); lens [N] long; kv_quant None (kv
    in q's dtype) or a quantized --kv-cache-dtype -> [N, Hq, D]. score_rows, logits: the
    rows that leave their logits (module docstring), or None."""
    args = (q, kv, layer, tables, lens, scale, kv_quant, window, softcap, score_rows, logits)
    if (kv.device.type == "cpu" and q.shape[0] <= KERNEL_MAX_ROWS
            and kv_quant in (None, "int8") and kernel_unavailable() is None):
        return kernel_decode(*args)
    return gathered_decode(*args)


def decode_write(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv: torch.Tensor, slots: DecodeSlots, params: LayerAttention) -> torch.Tensor:
    """One layer of a decode step compiled as one graph (engine/compile/decode.py): this
    step's K and V written into their slots and the rows' attention, one kernel call
    (``tandem::paged_decode_write``, which declares the cache it writes, so the graph
    orders the layers' writes and reads) -> [R, Hq, D]. A cache in the compute dtype,
    on CPU, with the kernel built (``graph_decode_unavailable``)."""
    return torch.ops.tandem.paged_decode_write(
        q.contiguous(), k, v, kv, slots.blocks, slots.offsets, layer, slots.tables,
        slots.lens, params.scale, params.window or 0, params.softcap or 0.0)


def graph_decode_unavailable(device: torch.device, kv_quant: str | None) -> str | None:
    """Why ``decode_write`` cannot serve a step here, or None where it can."""
    if device.type != "cpu":
        return "the one-graph decode step is CPU-only"
    if kv_quant is not None:
        return f"--kv-cache-dtype {kv_quant} is decoded per layer"
    return kernel_unavailable()


def kernel_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                  lens: torch.Tensor, scale: float, kv_quant: str | None = None,
                  window: int | None = None, softcap: float | None = None,
                  score_rows: torch.Tensor | None = None, logits: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The in-place kernel (window 0 / softcap 0.0 mean none there). An int8 cache holds
    rotated rows (engine/kv_cache/quant.py): the kernel gets the rotated query (q . k is
    unchanged) and its output, a weighted sum of rotated values, is rotated back."""
    extra = (window or 0, softcap or 0.0, score_rows, logits)
    if kv_quant is None:
        return torch.ops.tandem.paged_decode(q.contiguous(), kv, layer, tables, lens, scale,
                                             *extra)
    r = rotation(q.shape[-1], q.device)
    qr = (q.float() @ r).to(q.dtype).contiguous()
    out = torch.ops.tandem.paged_decode(qr, kv, layer, tables, lens, scale, *extra)
    return (out.float() @ r).to(q.dtype)


def gathered_decode(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, kv_quant: str | None = None,
                    window: int | None = None, softcap: float | None = None,
                    score_rows: torch.Tensor | None = None, logits: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The fallback: gather each row's blocks from the first its window reaches (padded to
    the widest row), one batched attention with a key mask (SDPA: faster on CPU than an
    explicit matmul-softmax-matmul over the same gather); the scored rows' logits apart."""
    n, bs = q.shape[0], kv.shape[3]
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0) // bs
    width = int(((lens + bs - 1) // bs - first).max())
    cols = (first.unsqueeze(1) + torch.arange(width, device=q.device)).clamp(
        max=tables.shape[1] - 1)  # [N, width]: past a row's end, padding (masked)
    ids = tables.gather(1, cols).reshape(-1)
    ks, vs = gather_blocks(layer, kv, ids, kv_quant, q.dtype)  # [N*width, B, Hkv, D]
    ks = ks.view(n, -1, *ks.shape[-2:]).transpose(1, 2)  # [N, Hkv, S, D]
    vs = vs.view(n, -1, *vs.shape[-2:]).transpose(1, 2)
    kpos = first.unsqueeze(1) * bs + torch.arange(ks.shape[2], device=q.device)  # [N, S]
    mask = visible((lens - 1).view(n, 1, 1, 1), kpos[:, None, None, :], window)
    params = LayerAttention(scale, window, softcap)
    out = masked_attention(q.unsqueeze(2), ks, vs, mask, params)  # [N, Hq, 1, D]
    if score_rows is not None:
        for i in (score_rows >= 0).nonzero().flatten().tolist():
            lg = attention_logits(q[i:i + 1].unsqueeze(2), ks[i:i + 1], mask[i:i + 1], params)
            s0, w = int(first[i]) * bs, min(ks.shape[2], logits.shape[-1] - int(first[i]) * bs)
            logits[int(score_rows[i]), :, s0:s0 + w] = lg[0, :, 0, :w]
    return out.squeeze(2)
