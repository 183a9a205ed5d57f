"""Llama family (Llama 2/3, SmolLM, Mistral-without-sliding-window): RMSNorm,
RoPE, SwiGLU, GQA, tied or untied embeddings.

The model holds weights only. The runner owns the KV cache and the attention
backend and passes both in a ForwardContext each step. Q/K/V and gate/up are
fused into one matmul each (fewer, larger GEMMs: batch-1 decode on CPU is
overhead-bound); the HF checkpoint names are mapped once, in ``_FUSED``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.layers.rms_norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary

# HF name suffix -> (our fused parameter, shard index within it)
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}


def checkpoint_names(module_path: str, tie_word_embeddings: bool) -> list[str]:
    """HF checkpoint tensors that make up one of our linear layers, in shard order
    (``model.layers.0.self_attn.qkv_proj`` -> its q, k and v projections)."""
    if module_path == "lm_head" and tie_word_embeddings:
        return ["model.embed_tokens.weight"]
    target = module_path + ".weight"
    shards = sorted((idx, suffix) for suffix, (fused, idx) in _FUSED.items()
                    if target.endswith(fused))
    if not shards:
        return [target]
    prefix = target[: -len(_FUSED[shards[0][1]][0])]
    return [prefix + suffix for _, suffix in shards]


@dataclass
class ForwardContext:
    """What one forward pass needs besides tokens: injected by the runner."""

    kv: torch.Tensor
    """[num_blocks, num_layers, 2, block_size, Hkv, D] — the whole paged cache."""
    meta: AttentionMetadata
    backend: AttentionBackend
    should_stop: Callable[[], bool] | None = None
    """Asked between layers; True abandons the pass (StepInterrupted)."""


class StepInterrupted(Exception):
    """A forward pass was abandoned between layers: a more important request arrived.
    Nothing of the step counts (its KV writes lie beyond every computed position)."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=False)
        self.params = LayerAttention(scale=self.d ** -0.5)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden [T, H] -> rotated q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rotary(q.view(t, self.hq, self.d), cos, sin)  # [T, Hq, D]
        k = apply_rotary(k.view(t, self.hkv, self.d), cos, sin)  # [T, Hkv, D]
        return q, k, v.view(t, self.hkv, self.d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor:
        """The paged-cache part (writes K/V, never compiled) -> o [T, Hq * D]."""
        o = ctx.backend.forward(self.layer, q, k, v, ctx.kv, ctx.meta, self.params)  # [T, Hq, D]
        return o.reshape(q.shape[0], self.hq * self.d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Residual stream [T, H] -> q, k, v of this layer's attention."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attn_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual [T, H] and attention output [T, Hq * D] -> the layer's output [T, H]."""
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


def first_segment(model: "LlamaModel", input_ids: torch.Tensor, positions: torch.Tensor):
    """Embedding, RoPE tables and layer 0 up to its attention -> (x, cos, sin, q, k, v)."""
    x = model.embed_tokens(input_ids)  # [T, H]
    cos, sin = model.rotary.tables(positions, x.dtype)  # [T, 1, D]
    return (x, cos, sin, *model.layers[0].attn_in(x, cos, sin))


def middle_segment(prev: DecoderLayer, nxt: DecoderLayer, x: torch.Tensor, o: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor):
    """From one layer's attention to the next one's -> (x, q, k, v)."""
    x = prev.attn_out(x, o)
    return (x, *nxt.attn_in(x, cos, sin))


def last_segment(prev: DecoderLayer, norm: RMSNorm, x: torch.Tensor, o: torch.Tensor
                 ) -> torch.Tensor:
    """The last layer after its attention, and the final norm -> hidden [T, H]."""
    return norm(prev.attn_out(x, o))


@dataclass(frozen=True)
class Segments:
    """The three pieces of a forward pass between attention calls. Eager by default;
    engine/compile/ hands in compiled ones, and pads the rows to a bucket (``rows``
    real rows reach attention; the padding rows are computed and dropped)."""

    first: Callable = first_segment
    middle: Callable = middle_segment
    last: Callable = last_segment


EAGER = Segments()


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                seg: Segments = EAGER, rows: int | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]. With ``rows`` < T the
        last T - rows tokens are padding: they never reach attention or the KV cache.
        ctx.should_stop is asked before every layer but the first. ``num_layers`` runs
        only the first layers, then the final norm (a self-draft, engine/spec/draft.py)."""
        n = input_ids.shape[0] if rows is None else rows
        pad = input_ids.shape[0] - n
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        x, cos, sin, q, k, v = seg.first(self, input_ids, positions)
        for i, layer in enumerate(layers):
            if i and ctx.should_stop is not None and ctx.should_stop():
                raise StepInterrupted
            if pad:
                q, k, v = q[:n], k[:n], v[:n]
            o = layer.self_attn.attend(q, k, v, ctx)  # [n, Hq * D]
            if pad:
                o = F.pad(o, (0, 0, 0, pad))
            if i + 1 < len(layers):
                x, q, k, v = seg.middle(layer, layers[i + 1], x, o, cos, sin)
        return seg.last(layers[-1], self.norm, x, o)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, ctx: ForwardContext, seg: Segments = EAGER,
                rows: int | None = None, num_layers: int | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, ctx, seg, rows, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, V] (only the rows the sampler needs)."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on a missing
        or unexpected weight, naming it."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        for name, w in tensors:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            if "rotary_emb" in name:
                continue
            target, shard = name, None
            for suffix, (fused, idx) in _FUSED.items():
                if name.endswith(suffix):
                    target, shard = name[: -len(suffix)] + fused, idx
            if target not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in the Llama model")
            p = params[target]
            if shard is None:
                p.copy_(w)
            else:
                p[self._shard_rows(target, shard)].copy_(w)
            seen.add(f"{target}#{shard}")
        self._check_complete(seen)

    def _shard_rows(self, target: str, shard: int) -> slice:
        c = self.cfg
        if target.endswith("qkv_proj.weight"):
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def _check_complete(self, seen: set[str]) -> None:
        want = {"model.embed_tokens.weight#None", "model.norm.weight#None"}
        if not self.cfg.tie_word_embeddings:
            want.add("lm_head.weight#None")
        for i in range(self.cfg.num_layers):
            pre = f"model.layers.{i}."
            want |= {pre + "input_layernorm.weight#None", pre + "post_attention_layernorm.weight#None",
                     pre + "self_attn.o_proj.weight#None", pre + "mlp.down_proj.weight#None"}
            want |= {f"{pre}self_attn.qkv_proj.weight#{j}" for j in range(3)}
            want |= {f"{pre}mlp.gate_up_proj.weight#{j}" for j in range(2)}
        missing = sorted(want - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. "
                             f"{missing[0].split('#')[0]}")
