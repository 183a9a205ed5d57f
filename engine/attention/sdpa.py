"""torch scaled_dot_product_attention over the paged cache.

Prefill sequences run one SDPA each over their gathered context (causal with the
cached prefix in front: an explicit mask when a prefix exists). Decoding
sequences run as one batched SDPA over their contexts padded to the longest,
with a key-padding mask. On CUDA, SDPA dispatches to a FlashAttention kernel; on
CPU to a fused kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, gather_blocks, gather_kv, write_kv
from engine.attention.metadata import AttentionMetadata


def _causal_mask(qlen: int, slen: int, device) -> torch.Tensor:
    """[Lq, S] bool, True where query i (at position slen-qlen+i) may see key j."""
    qpos = torch.arange(slen - qlen, slen, device=device).unsqueeze(1)
    return torch.arange(slen, device=device).unsqueeze(0) <= qpos


def _decode_inputs(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables [N, maxb] and a key mask [N, 1, 1, maxb*B] for the decodes."""
    p = meta.num_prefills
    lens = meta.seq_lens[p:]
    maxb = -(-max(lens) // meta.block_size)
    tables = [t[:maxb] + [0] * (maxb - len(t[:maxb])) for t in meta.block_tables[p:]]
    bt = torch.tensor(tables, dtype=torch.long, device=device)
    keys = torch.arange(maxb * meta.block_size, device=device)
    mask = keys.unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
    return bt, mask[:, None, None, :]


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def forward(self, layer, q, k, v, kv, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(layer, k, v, kv, meta)
        out = torch.empty_like(q)
        start = 0
        for i in range(meta.num_prefills):
            qlen, slen = meta.query_lens[i], meta.seq_lens[i]
            ks, vs = gather_kv(layer, kv, meta.block_tables[i], slen)
            qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            mask = None if qlen == slen else meta.cached(
                f"pmask{i}", lambda: _causal_mask(qlen, slen, q.device))
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        if meta.num_decodes:
            bt, mask = meta.cached("decode", lambda: _decode_inputs(meta, q.device))
            n = bt.shape[0]
            ks, vs = gather_blocks(layer, kv, bt.view(-1))  # [N*maxb, B, Hkv, D] each
            ks = ks.view(n, -1, *ks.shape[-2:]).transpose(1, 2)  # [N, Hkv, S, D]
            vs = vs.view(n, -1, *vs.shape[-2:]).transpose(1, 2)
            qs = q[start:].unsqueeze(2)  # [N, Hq, 1, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[start:] = o.squeeze(2)
        return out
