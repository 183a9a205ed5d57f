"""torch scaled_dot_product_attention over the paged cache.

Prefill sequences on CPU run paged_prefill.py's kernel, which reads K/V in place
through the block table. Elsewhere (CUDA, a quantized cache, rows that owe h2o scores,
no compiler) each runs one SDPA over its gathered context (causal with the cached
prefix in front: an explicit mask when a prefix exists or the layer has a sliding
window, whose context is gathered from the first block the chunk's earliest query can
see). On CUDA, SDPA dispatches to a FlashAttention kernel; on CPU to a fused kernel.
A soft-capped layer takes the explicit fp32 form (base.masked_attention): SDPA has no
soft-cap. Decoding sequences (and speculative verification, whose 1 + k
queries arrive as k + 1 decode rows) run through paged_decode.py: on CPU a kernel
that reads K/V in place through the block tables, skipping keys before the window
(the CPU SDPA kernel was slow for single-token queries and needed every context
gathered first, once per layer). A quantized cache: the prefill path dequantizes the
gathered context to the compute dtype; the decode kernel dequantizes int8 rows as it
reads them (fp8 takes the gathered path).

Rows that owe attention scores (``meta.scores``, h2o): a prefill row takes the explicit
fp32 form (its probabilities are the scores' source); decode rows get their scaled
logits from the kernel as it computes them (no second read of the cache), then one
softmax over those [Hq, len] logits.
"""
from __future__ import annotations

import torch

from engine.attention.base import (AttentionBackend, LayerAttention, add_scores,
                                   attention_probs, first_key, gather_kv, masked_attention,
                                   visible)
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged_decode import paged_decode
from engine.attention.paged_prefill import paged_prefill


def _prefill_mask(qlen: int, slen: int, start: int, window: int | None,
                  device) -> torch.Tensor:
    """[Lq, S - start] bool: query i (at position slen-qlen+i) may see key j (at start+j)."""
    qpos = torch.arange(slen - qlen, slen, device=device).unsqueeze(1)
    return visible(qpos, torch.arange(start, slen, device=device).unsqueeze(0), window)


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

    supports = frozenset({"window", "softcap"})
    decodes_in_graph = True

    def attend(self, layer, q, kv, meta: AttentionMetadata, params: LayerAttention, out) -> None:
        start = 0
        for i in range(meta.num_prefills):
            qlen, slen = meta.query_lens[i], meta.seq_lens[i]
            if i not in meta.scores and kv.is_cpu:  # in place over the paged cache
                table = meta.cached(f"ptable{i}", lambda: torch.tensor(
                    meta.block_tables[i], dtype=torch.long, device=q.device))
                o = paged_prefill(q[start:start + qlen], kv, layer, table, slen, params,
                                  meta.kv_quant)
                if o is not None:
                    out[start:start + qlen] = o
                    start += qlen
                    continue
            first = first_key(slen - qlen, params.window)
            ks, vs = gather_kv(layer, kv, meta.block_tables[i], slen, meta.kv_quant, q.dtype,
                               start=first)
            qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            plain = qlen == slen and params.window is None  # causal over a square
            mask = None if plain else meta.cached(
                f"pmask{i}:{params.window}",
                lambda: _prefill_mask(qlen, slen, first, params.window, q.device))
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            probs = None
            if i in meta.scores:
                probs = attention_probs(qs, ks, mask, params)  # [1, Hq, Lq, S]
                add_scores(meta, i, layer, probs[0], first)
            o = masked_attention(qs, ks, vs, mask, params, probs)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        if meta.num_decodes:
            self._decode(layer, q[start:], kv, meta, params, out[start:])

    @staticmethod
    def _decode(layer: int, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                params: LayerAttention, out: torch.Tensor) -> None:
        p = meta.num_prefills
        bt, lens = meta.cached("decode", lambda: _decode_inputs(meta, q.device))
        scored = sorted(i for i in meta.scores if i >= p)
        rows = logits = None
        if scored:
            rows = meta.cached("score_rows", lambda: torch.tensor(
                [scored.index(i) if i in scored else -1 for i in range(p, len(meta.seq_lens))],
                dtype=torch.long, device=q.device))
            width = max(meta.seq_lens[i] for i in scored)
            logits = torch.full((len(scored), q.shape[1], width), float("-inf"),
                                device=q.device)
        out[:] = paged_decode(q, kv, layer, bt, lens, params.scale, meta.kv_quant,
                              params.window, params.softcap, rows, logits)
        if scored:
            probs = logits.softmax(-1)  # [M, Hq, width]
            for j, i in enumerate(scored):
                add_scores(meta, i, layer, probs[j, :, None, :meta.seq_lens[i]])
