"""torch scaled_dot_product_attention over the paged cache.

Prefill sequences run one SDPA each over their gathered context (causal with the
cached prefix in front: an explicit mask when a prefix exists). On CUDA, SDPA
dispatches to a FlashAttention kernel; on CPU to a fused kernel. Decoding
sequences run through paged_decode.py: on CPU a kernel that reads K/V in place
through the block tables (the CPU SDPA kernel was slow for single-token queries
and needed every context gathered first, once per layer). A quantized cache: the
prefill path dequantizes the gathered context to the compute dtype; the decode kernel
dequantizes int8 rows as it reads them (fp8 takes the gathered path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, LayerAttention, gather_kv
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged_decode import paged_decode


def _causal_mask(qlen: int, slen: int, device) -> torch.Tensor:
    """[Lq, S] bool, True where query i (at position slen-qlen+i) may see key j."""
    qpos = torch.arange(slen - qlen, slen, device=device).unsqueeze(1)
    return torch.arange(slen, device=device).unsqueeze(0) <= qpos


def _decode_inputs(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [N, maxb] (padded with block 0, never read) and lengths [N]."""
    p = meta.num_prefills
    lens = meta.seq_lens[p:]
    maxb = -(-max(lens) // meta.block_size)
    tables = [t[:maxb] + [0] * (maxb - len(t[:maxb])) for t in meta.block_tables[p:]]
    return (torch.tensor(tables, dtype=torch.long, device=device),
            torch.tensor(lens, dtype=torch.long, device=device))


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def attend(self, layer, q, kv, meta: AttentionMetadata, params: LayerAttention, out) -> None:
        scale = params.scale
        start = 0
        for i in range(meta.num_prefills):
            qlen, slen = meta.query_lens[i], meta.seq_lens[i]
            ks, vs = gather_kv(layer, kv, meta.block_tables[i], slen, meta.kv_quant, q.dtype)
            qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            mask = None if qlen == slen else meta.cached(
                f"pmask{i}", lambda: _causal_mask(qlen, slen, q.device))
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        if meta.num_decodes:
            bt, lens = meta.cached("decode", lambda: _decode_inputs(meta, q.device))
            out[start:] = paged_decode(q[start:], kv, layer, bt, lens, scale, meta.kv_quant)
