"""The reference: explicit softmax(QK^T)V per sequence in fp32, GQA by repetition (a
quantized cache dequantized to fp32: code * scale). With a sliding window it reads
from the first block the row's earliest query can see (earlier blocks may be freed)
and masks the rest by the definition in LayerAttention.

Slow and obviously right; every other backend is tested against it.
"""
from __future__ import annotations

import torch

from engine.attention.base import (AttentionBackend, LayerAttention, add_scores, first_key,
                                   gather_kv)
from engine.attention.metadata import AttentionMetadata


class NaiveBackend(AttentionBackend):
    name = "naive"

    supports = frozenset({"window", "softcap"})

    def attend(self, layer, q, kv, meta: AttentionMetadata, params: LayerAttention, out) -> None:
        start = 0
        rep = q.shape[1] // kv.shape[-2]
        for seq, (qlen, slen, table) in enumerate(zip(meta.query_lens, meta.seq_lens,
                                                      meta.block_tables)):
            qs = q[start:start + qlen].float()  # [Lq, Hq, D]
            first = first_key(slen - qlen, params.window)  # (blocks before: maybe freed)
            ks, vs = gather_kv(layer, kv, table, slen, meta.kv_quant, torch.float32, first)
            ks = ks.float().repeat_interleave(rep, dim=1)  # [S, Hq, D], keys first..slen-1
            vs = vs.float().repeat_interleave(rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * params.scale  # [Hq, Lq, S]
            if params.softcap is not None:
                scores = params.softcap * torch.tanh(scores / params.softcap)
            qpos = torch.arange(slen - qlen, slen).unsqueeze(1)
            kpos = torch.arange(first, slen).unsqueeze(0)
            hidden = kpos > qpos
            if params.window is not None:
                hidden |= kpos <= qpos - params.window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = scores.softmax(-1)
            if seq in meta.scores:
                add_scores(meta, seq, layer, probs, first)
            out[start:start + qlen] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
            start += qlen
