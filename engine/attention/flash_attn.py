"""The flash-attn package on CUDA: varlen prefill and KV-cache decode.

flash-attn 2 reads a paged cache directly only when the page size is a multiple
of 256 tokens; with smaller blocks (the default 16) we gather each sequence's
context through its block table first and hand flash-attn dense tensors. Both
paths are numerically the same kernel. A quantized cache (int8, fp8_e4m3 with our
per-row scales) is dequantized as it is gathered: flash-attn 2 has no KV-dequantizing
kernel for per-token scales, so nothing is fused here. Tested against the naive reference when
CUDA is present (tests/engine/test_attention.py, marked gpu).
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, LayerAttention, gather_kv
from engine.attention.metadata import AttentionMetadata


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

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
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        scale = params.scale
        p, ntok = meta.num_prefills, meta.num_prefill_tokens
        if p:
            ks, vs = zip(*(gather_kv(layer, kv, meta.block_tables[i], meta.seq_lens[i],
                                     meta.kv_quant, q.dtype) for i in range(p)))
            cu_q, cu_k = meta.cached("fa_cu", lambda: _cu_seqlens(meta, q.device))
            out[:ntok] = flash_attn_varlen_func(
                q[:ntok], torch.cat(ks), torch.cat(vs), cu_q, cu_k,
                max(meta.query_lens[:p]), max(meta.seq_lens[:p]),
                softmax_scale=scale, causal=True)  # bottom-right causal: prefix visible
        if meta.num_decodes:
            lens = meta.seq_lens[p:]
            cache_lens = meta.cached("fa_lens", lambda: torch.tensor(
                lens, dtype=torch.int32, device=q.device))
            if meta.block_size % 256 == 0 and meta.kv_quant is None:
                bt = meta.cached("fa_bt", lambda: _padded_tables(meta, q.device))
                kc, vc = kv[:, layer, 0], kv[:, layer, 1]
            else:
                pairs = [gather_kv(layer, kv, meta.block_tables[p + i], n, meta.kv_quant, q.dtype)
                         for i, n in enumerate(lens)]
                kc = torch.nn.utils.rnn.pad_sequence([a for a, _ in pairs], batch_first=True)
                vc = torch.nn.utils.rnn.pad_sequence([b for _, b in pairs], batch_first=True)
                bt = None
            out[ntok:] = flash_attn_with_kvcache(
                q[ntok:].unsqueeze(1), kc, vc, cache_seqlens=cache_lens, block_table=bt,
                softmax_scale=scale, causal=True).squeeze(1)


def _cu_seqlens(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    p = meta.num_prefills
    cu_q = torch.zeros(p + 1, dtype=torch.int32, device=device)
    cu_k = torch.zeros(p + 1, dtype=torch.int32, device=device)
    cu_q[1:] = torch.tensor(meta.query_lens[:p], device=device).cumsum(0)
    cu_k[1:] = torch.tensor(meta.seq_lens[:p], device=device).cumsum(0)
    return cu_q, cu_k


def _padded_tables(meta: AttentionMetadata, device) -> torch.Tensor:
    tables = meta.block_tables[meta.num_prefills:]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=device)
