"""The attention backend contract and its registry.

A backend is stateless apart from what it caches in ``meta.scratch`` for one step.
``forward`` has one side effect: it writes the new tokens' K and V into the KV
cache at ``meta.slot_blocks / meta.slot_offsets`` before attending, so a token
attends to itself and to everything cached before it.

KV cache layout (block-major, the layout the KV-transfer layer ships): one tensor
``kv`` of shape [num_blocks, num_layers, 2, block_size, num_kv_heads, row];
block b of the whole model is one contiguous region. Unquantized, a row is head_dim
values in the compute dtype; with ``meta.kv_quant`` (int8, fp8_e4m3) it is head_dim
one-byte codes and the row's bfloat16 scale (engine/kv_cache/quant.py): ``write_kv``
quantizes, ``gather_blocks`` / ``gather_kv`` dequantize, so a backend that reads
through them needs nothing else.

Attention scores (``meta.scores``, for requests under ``h2o``: engine/kv_cache/h2o.py):
for the sequences named there, a backend adds each key's attention probability, summed
over the step's queries and over each KV head's group of query heads, into that
sequence's accumulator (``add_scores``), from the probabilities it computes anyway;
other sequences cost nothing. A backend that cannot (``gives_scores`` False) is refused
for h2o by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.quant import decode, encode
from engine.attention.registry import ATTENTION_BACKENDS


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention parameters (they differ by layer in some families)."""

    scale: float
    """Multiplies q.k before the soft-cap and softmax."""
    window: int | None = None
    """Sliding window: a query at position p sees keys at positions p - window + 1 .. p
    (``window`` keys, itself included, as transformers' sliding-window masks); None = all."""
    softcap: float | None = None
    """Logit soft-cap: scores become softcap * tanh(scores / softcap) before the softmax."""


class AttentionBackend(ABC):
    name: str
    supports: frozenset[str] = frozenset()
    """The optional LayerAttention fields ("window", "softcap") this backend computes;
    a model asking for another is refused by ``check`` at start-up, never ignored."""
    gives_scores: bool = True
    """Whether ``attend`` fills ``meta.scores`` (module docstring)."""
    decodes_in_graph: bool = False
    """Whether its decode rows on CPU are the paged decode kernel, which a decode step
    compiled as one graph calls itself (engine/attention/paged_decode.py decode_write)
    where this backend would: the one-graph step computes what ``attend`` would."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: torch.Tensor, meta: AttentionMetadata, params: LayerAttention
                ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D].

        Writes k, v into ``kv[:, layer]`` first (see module docstring), then attends."""
        write_kv(layer, k, v, kv, meta)
        out = torch.empty_like(q)
        self.attend(layer, q, kv, meta, params, out)
        return out

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
               params: LayerAttention, out: torch.Tensor) -> None:
        """Fill ``out`` ([T, Hq, D]) with each row's attention over the paged cache, which
        already holds this step's K and V: the batch's prefill rows first (their
        ``query_lens``), then one row per decode."""

    def check(self, params: LayerAttention) -> None:
        """Refuse, naming --attention-backend, a layer this backend would compute wrongly."""
        asked = {f for f in ("window", "softcap") if getattr(params, f) is not None}
        missing = sorted(asked - self.supports)
        if missing:
            raise ValueError(f"--attention-backend {self.name} does not compute "
                             f"{' or '.join(missing)} attention, which this model's layers use; "
                             f"use --attention-backend naive")

    @classmethod
    def available(cls, device: torch.device) -> str | None:
        """None when usable on this device, else the reason it is not."""
        return None


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Scatter the new tokens' K/V into their slots (shared by every backend),
    quantized per row first when the cache is."""
    if meta.kv_quant is not None:
        k, v = encode(k, meta.kv_quant), encode(v, meta.kv_quant)
    kv[meta.slot_blocks, layer, 0, meta.slot_offsets] = k
    kv[meta.slot_blocks, layer, 1, meta.slot_offsets] = v


def gather_blocks(layer: int, kv: torch.Tensor, block_ids: torch.Tensor,
                  kv_quant: str | None = None, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks at one layer, [n, B, Hkv, D] each, contiguous; a
    quantized cache (kv_quant) is dequantized to ``dtype``.

    index_select over the block dimension of the layer's K (then V) view copies one
    contiguous [B, Hkv, row] run per block; advanced indexing (kv[ids, layer]) took 3.5x
    longer on CPU and then needed a second copy to split K from V."""
    k = kv[:, layer, 0].index_select(0, block_ids)
    v = kv[:, layer, 1].index_select(0, block_ids)
    if kv_quant is None:
        return k, v
    return decode(k, kv_quant, dtype), decode(v, kv_quant, dtype)


def first_key(first_query: int, window: int | None) -> int:
    """The earliest key position any query at or after ``first_query`` can see (0 without a
    window): backends read the cache from there on, so blocks wholly before a sliding
    window are never read (the KV manager may have freed them)."""
    return 0 if window is None else max(0, first_query - window + 1)


def gather_kv(layer: int, kv: torch.Tensor, table: list[int] | torch.Tensor, seq_len: int,
              kv_quant: str | None = None, dtype: torch.dtype | None = None, start: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V at positions start .. seq_len - 1, [seq_len - start, Hkv, D]
    each, read through its block table (blocks before ``start``'s are not read) and
    dequantized to ``dtype`` when kv_quant says the cache is quantized."""
    bs = kv.shape[3]
    first, nblocks = start // bs, -(-seq_len // bs)
    idx = torch.as_tensor(table[first:nblocks], dtype=torch.long, device=kv.device)
    k, v = gather_blocks(layer, kv, idx, kv_quant, dtype)
    skip = start - first * bs
    return (k.view(-1, *k.shape[-2:])[skip:seq_len - first * bs],
            v.view(-1, *v.shape[-2:])[skip:seq_len - first * bs])


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., Lq, S] bool from query positions [..., Lq, 1] and key positions [..., 1, S]:
    True where the key is at or before the query and, with a window, fewer than
    ``window`` positions before it."""
    seen = kpos <= qpos
    return seen if window is None else seen & (kpos > qpos - window)


def add_scores(meta: AttentionMetadata, seq: int, layer: int, probs: torch.Tensor,
               first: int = 0) -> None:
    """Add probs [Hq, Lq, S] (a sequence's attention probabilities, per query, over the
    keys at positions first .. first + S - 1) into its accumulator, per KV head, summed
    over the queries; under a decay d (``meta.score_decay``) query i of Lq counts
    d ** (Lq - 1 - i), as if each token had faded the ones before it (the accumulator's
    own fading, d ** Lq, is engine/kv_cache/h2o.py step_scores')."""
    acc = meta.scores[seq]  # [L, Hkv, slots]
    hkv, lq, s = acc.shape[1], probs.shape[1], probs.shape[-1]
    decay = meta.score_decay.get(seq)
    if decay is None or lq == 1:
        summed = probs.float().sum(1)
    else:
        w = decay ** torch.arange(lq - 1, -1, -1, dtype=torch.float64, device=probs.device)
        summed = torch.einsum("hqs,q->hs", probs.float(), w.float())
    acc[layer, :, first:first + s] += summed.view(hkv, -1, s).sum(1)


def attention_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                     params: LayerAttention) -> torch.Tensor:
    """cap(q.k * scale), -inf where masked, in fp32 with GQA: q [B, Hq, Lq, D], k [B, Hkv,
    S, D], mask broadcastable to [B, 1, Lq, S] (True = visible; None: causal over a square)
    -> [B, Hq, Lq, S]."""
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, Hq, S, D]
    s = q.float() @ kf.transpose(-1, -2) * params.scale  # [B, Hq, Lq, S]
    if params.softcap is not None:
        s = params.softcap * torch.tanh(s / params.softcap)
    if mask is None:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~mask, float("-inf"))


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                    params: LayerAttention) -> torch.Tensor:
    """softmax(attention_logits) [B, Hq, Lq, S] in fp32."""
    return attention_logits(q, k, mask, params).softmax(-1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, params: LayerAttention,
                     probs: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap(q.k * scale) | mask) v with GQA: q [B, Hq, Lq, D], k and v [B, Hkv, S, D],
    mask broadcastable to [B, 1, Lq, S] (True = visible; None: causal over a square) ->
    [B, Hq, Lq, D] in q's dtype. Without a soft-cap, torch's SDPA (fused on CPU, flash
    on CUDA); SDPA has no soft-cap, so capped layers take the explicit fp32 form, as do
    rows whose ``probs`` (attention_probs) the caller already computed for their scores."""
    if params.softcap is None and probs is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=params.scale, enable_gqa=True)
    if probs is None:
        probs = attention_probs(q, k, mask, params)
    vf = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # [B, Hq, S, D]
    return (probs @ vf).to(q.dtype)


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """``auto`` picks flash_attn when usable, else sdpa. An explicit name that cannot
    run here is an error naming --attention-backend, never a silent fallback."""
    device = torch.device(device)
    if name == "auto":
        fa = ATTENTION_BACKENDS.load("flash_attn")
        return fa() if fa.available(device) is None else ATTENTION_BACKENDS.load("sdpa")()
    ATTENTION_BACKENDS.check(name, extra=("auto",))
    cls = ATTENTION_BACKENDS.load(name)
    reason = cls.available(device)
    if reason is not None:
        raise RuntimeError(f"--attention-backend {name} cannot run here: {reason}")
    return cls()
