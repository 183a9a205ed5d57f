"""The flash-attn package on CUDA: varlen prefill and KV-cache decode.

flash-attn 2 reads a paged cache directly only when the page size is a multiple
of 256 tokens; with smaller blocks (the default 16) we gather each sequence's
context through its block table first and hand flash-attn dense tensors. Both
paths are numerically the same kernel. A quantized cache (int8, fp8_e4m3 with our
per-row scales) is dequantized as it is gathered: flash-attn 2 has no KV-dequantizing
kernel for per-token scales, so nothing is fused here. Tested against the naive reference when
CUDA is present (tests/engine/test_attention.py, marked gpu).

Sliding windows and soft-caps are flash-attn's own: ``window_size=(window - 1, 0)`` (a
query at position i sees keys i - (window - 1) .. i, bottom-right aligned as ``causal``)
and ``softcap=``. Gathered contexts start at the first block a row's window reaches
(earlier blocks may be freed); the paged path hands flash-attn the whole table with
freed entries pointing at block 0, which its local-attention kernel skips with the rest
of the blocks before the window. The window and soft-cap arguments have not been run
here (no CUDA machine in this project's CI): the gpu-marked tests cover them.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, LayerAttention, first_key, gather_kv
from engine.attention.metadata import AttentionMetadata


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    supports = frozenset({"window", "softcap"})
    gives_scores = False  # flash-attn returns no probabilities (h2o is refused)

    @classmethod
    def available(cls, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "needs a CUDA device (this one is %s)" % device
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return "the flash-attn package is not installed (pip install 'tandem[gpu]')"
        return None

    def attend(self, layer, q, kv, meta: AttentionMetadata, params: LayerAttention, out) -> None:
        from flash_attn import flash_attn_varlen_func

        opts = dict(softmax_scale=params.scale, causal=True, softcap=params.softcap or 0.0,
                    window_size=(-1, -1) if params.window is None else (params.window - 1, 0))
        p, ntok = meta.num_prefills, meta.num_prefill_tokens
        if p:
            firsts = [first_key(meta.seq_lens[i] - meta.query_lens[i], params.window)
                      for i in range(p)]
            ks, vs = zip(*(gather_kv(layer, kv, meta.block_tables[i], meta.seq_lens[i],
                                     meta.kv_quant, q.dtype, firsts[i]) for i in range(p)))
            klens = [n - f for n, f in zip(meta.seq_lens[:p], firsts)]
            cu_q, cu_k = meta.cached(f"fa_cu:{params.window}",
                                     lambda: _cu_seqlens(meta.query_lens[:p], klens, q.device))
            out[:ntok] = flash_attn_varlen_func(
                q[:ntok], torch.cat(ks), torch.cat(vs), cu_q, cu_k,
                max(meta.query_lens[:p]), max(klens), **opts)  # bottom-right: prefix visible
        if meta.num_decodes:
            out[ntok:] = self._decode(layer, q[ntok:], kv, meta, params, opts)

    @staticmethod
    def _decode(layer: int, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                params: LayerAttention, opts: dict) -> torch.Tensor:
        """One query per row: the paged kernel reads the cache through the block tables
        (block size a multiple of 256, unquantized), else each row's visible context is
        gathered (from its window's first block) and padded."""
        from flash_attn import flash_attn_with_kvcache

        lens = meta.seq_lens[meta.num_prefills:]
        if meta.block_size % 256 == 0 and meta.kv_quant is None:
            bt = meta.cached("fa_bt", lambda: _padded_tables(meta, q.device))
            kc, vc = kv[:, layer, 0], kv[:, layer, 1]
            klens = lens
        else:
            firsts = [first_key(n - 1, params.window) for n in lens]
            pairs = [gather_kv(layer, kv, meta.block_tables[meta.num_prefills + i], n,
                               meta.kv_quant, q.dtype, firsts[i]) for i, n in enumerate(lens)]
            kc = torch.nn.utils.rnn.pad_sequence([a for a, _ in pairs], batch_first=True)
            vc = torch.nn.utils.rnn.pad_sequence([b for _, b in pairs], batch_first=True)
            bt, klens = None, [n - f for n, f in zip(lens, firsts)]
        cache_lens = torch.tensor(klens, dtype=torch.int32, device=q.device)
        return flash_attn_with_kvcache(q.unsqueeze(1), kc, vc, cache_seqlens=cache_lens,
                                       block_table=bt, **opts).squeeze(1)


def _cu_seqlens(qlens: list[int], klens: list[int], device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q = torch.zeros(len(qlens) + 1, dtype=torch.int32, device=device)
    cu_k = torch.zeros(len(klens) + 1, dtype=torch.int32, device=device)
    cu_q[1:] = torch.tensor(qlens, device=device).cumsum(0)
    cu_k[1:] = torch.tensor(klens, device=device).cumsum(0)
    return cu_q, cu_k


def _padded_tables(meta: AttentionMetadata, device) -> torch.Tensor:
    """[N, width] int32, padded (and freed entries, which are negative) with block 0."""
    tables = meta.block_tables[meta.num_prefills:]
    width = max(len(t) for t in tables)
    return torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables],
                        dtype=torch.int32, device=device)
