"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), (1 + w) RMS norms,
a norm after each block as well as before it, GeGLU, attention scaled by
``query_pre_attn_scalar``, and local (sliding-window) layers between global ones.
Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 drops the caps
(unless its config sets them), norms q and k per head, and gives local and global
layers their own rotary bases."""
from __future__ import annotations

from engine.attention.base import LayerAttention
from engine.config import ModelConfig
from engine.layers.activation import gate_fn
from engine.layers.attention import Attention
from engine.layers.decoder import SandwichDecoderLayer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, check_scaling
from engine.models.base import CausalLM, DecoderModel

GLOBAL, LOCAL = 0, 1
"""Indexes of Gemma 3's two rotary tables (Gemma 2 has only the first)."""


def _norm(cfg: ModelConfig):
    return lambda d=cfg.hidden_size: GemmaRMSNorm(d, cfg.rms_norm_eps)


def gemma_layer(cfg: ModelConfig, i: int, window: int | None, gemma3: bool) -> SandwichDecoderLayer:
    """One layer; Gemma 3's also norm q and k per head and read the local rotary table
    where they slide."""
    params = LayerAttention(scale=cfg.need("query_pre_attn_scalar", float) ** -0.5,
                            window=window, softcap=cfg.get("attn_logit_softcapping"))
    attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, params,
                     bias=cfg.attention_bias, out_bias=cfg.attention_bias,
                     qk_norm=_norm(cfg) if gemma3 else None,
                     rope=LOCAL if gemma3 and window is not None else GLOBAL)
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, gate_fn(cfg.hidden_act, cfg.source))
    return SandwichDecoderLayer(attn, mlp, _norm(cfg))


class _Gemma(CausalLM):
    def __init__(self, cfg: ModelConfig, layers: list[SandwichDecoderLayer],
                 rotaries: list[RotaryEmbedding]) -> None:
        model = DecoderModel(cfg, layers, _norm(cfg)(), rotaries, embed_scale=cfg.hidden_size ** 0.5)
        super().__init__(cfg, model, final_softcap=cfg.get("final_logit_softcapping"))


class Gemma2ForCausalLM(_Gemma):
    architecture = "gemma2"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        layers = [gemma_layer(cfg, i, cfg.layer_window(i, i % 2 == 0), gemma3=False)
                  for i in range(cfg.num_layers)]
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        super().__init__(cfg, layers, [rotary])


def _local_rope(cfg: ModelConfig) -> tuple[float, dict | None]:
    """The local layers' (theta, scaling): transformers >= 5 nests it in rope_parameters,
    older configs name only its base (rope_local_base_freq) and never scale it."""
    nested = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if nested is None:
        return float(cfg.get("rope_local_base_freq", 10000.0)), None
    scaling = nested if nested.get("rope_type", "default") != "default" else None
    check_scaling(scaling, cfg.source)
    return float(nested.get("rope_theta", 10000.0)), scaling


class Gemma3ForCausalLM(_Gemma):
    architecture = "gemma3"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.source}: use_bidirectional_attention is not supported "
                             f"(an embedding model, not a causal LM)")
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern", 6))
        layers = [gemma_layer(cfg, i, cfg.layer_window(i, (i + 1) % pattern != 0), gemma3=True)
                  for i in range(cfg.num_layers)]
        local_theta, local_scaling = _local_rope(cfg)
        rotaries = [RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
                    RotaryEmbedding(cfg.head_dim, max_positions, local_theta, local_scaling)]
        super().__init__(cfg, layers, rotaries)
