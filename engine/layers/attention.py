"""The attention layer: fused q/k/v projection, optional per-head q/k norms, rotary,
the paged-cache attention through the injected backend with this layer's own
LayerAttention (scale, sliding window, logit soft-cap), and the output projection.

``project`` (pure tensor math, compiled by engine/compile/) and ``attend`` (writes the
KV cache through the backend, eager) are separate so a compiled step can stop between
them; ``attend_slots`` is the one-graph decode step's attention (its write included).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from engine.attention.base import AttentionBackend, LayerAttention
from engine.attention.metadata import AttentionMetadata, DecodeSlots
from engine.attention.paged_decode import decode_write
from engine.layers.linear import Linear, single
from engine.layers.rotary import apply_rotary

RopeTables = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""(cos, sin) per rotary embedding of the model, each [T, 1, D]; a layer reads its own."""



class PagedCache(Protocol):
    """What ``attend`` reads of a step's context (engine/models/base.py ForwardContext)."""

    kv: torch.Tensor
    meta: AttentionMetadata
    backend: AttentionBackend


class Attention(nn.Module):
    def __init__(self, layer: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 params: LayerAttention, *, bias: bool = False, out_bias: bool = False,
                 qkv: Sequence[str] = ("q_proj", "k_proj", "v_proj"),
                 qk_norm: Callable[[int], nn.Module] | None = None, rope: int = 0) -> None:
        """bias / out_bias: q/k/v (Qwen2) / o_proj carry biases. qkv: the checkpoint's names for the q, k and v projections, or one name where
        it stores them fused. qk_norm: builds a norm over head_dim applied to each head
        of q and k before rotary (Qwen3, Gemma 3). rope: which of the model's rotary
        tables this layer uses (Gemma 3's local and global layers have their own)."""
        super().__init__()
        self.layer, self.rope = layer, rope
        self.hq, self.hkv, self.d = heads, kv_heads, head_dim
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        shards = [(qkv[0], sum(sizes))] if len(qkv) == 1 else list(zip(qkv, sizes))
        self.qkv_proj = Linear(hidden, shards, bias=bias)
        self.o_proj = single(heads * head_dim, hidden, "o_proj", bias=out_bias, parallel="row")
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.params = params

    def project(self, x: torch.Tensor, rope: RopeTables
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden [T, H] -> rotated q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.rope]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.view(t, self.hkv, self.d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx: PagedCache) -> torch.Tensor:
        """The paged-cache part (writes K/V, never compiled) -> o [T, Hq * D]."""
        o = ctx.backend.forward(self.layer, q, k, v, ctx.kv, ctx.meta, self.params)  # [T, Hq, D]
        return o.reshape(q.shape[0], self.hq * self.d)

    def attend_slots(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                     slots: DecodeSlots) -> torch.Tensor:
        """``attend`` for a decode step compiled as one graph (engine/models/base.py
        decode_graph): the CPU decode kernel with the write in it -> o [R, Hq * D]."""
        o = decode_write(self.layer, q, k, v, kv, slots, self.params)
        return o.reshape(q.shape[0], self.hq * self.d)
