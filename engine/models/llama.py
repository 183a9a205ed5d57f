"""Llama family (Llama 2/3, SmolLM): RMSNorm, RoPE (default, linear or Llama 3
scaling), SwiGLU, GQA, tied or untied embeddings; optional q/k/v/o biases
(``attention_bias``). Q/K/V and gate/up run as one matmul each (fewer, larger GEMMs:
batch-1 decode on CPU is overhead-bound), filled from the checkpoint's separate tensors.
Mistral, Qwen2/3 and Phi-3 are this layer with one thing changed (``llama_layer``'s
keywords).
"""
from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from engine.attention.base import LayerAttention
from engine.config import ModelConfig
from engine.layers.activation import gate_fn
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import (  # noqa: F401  (the contract, re-exported for older imports)
    EAGER, CausalLM, DecoderModel, ForwardContext, Segments, StepInterrupted)

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
_FUSED = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}


def checkpoint_names(module_path: str, tie_word_embeddings: bool) -> list[str]:
    """HF checkpoint tensors that make up one of a Llama's linear layers, in shard order
    (``model.layers.0.self_attn.qkv_proj`` -> its q, k and v projections): by path
    alone, so it also answers for a model whose linears were swapped for packed ones."""
    if module_path == "lm_head" and tie_word_embeddings:
        return ["model.embed_tokens.weight"]
    parent, _, name = module_path.rpartition(".")
    return [f"{parent}.{shard}.weight" for shard in _FUSED.get(name, (name,))]


def llama_layer(cfg: ModelConfig, i: int, *, window: int | None = None,
                qkv_bias: bool | None = None, qk_norm: Callable[[int], nn.Module] | None = None,
                qkv: Sequence[str] = QKV, gate_up: Sequence[str] = GATE_UP,
                mlp: nn.Module | None = None) -> DecoderLayer:
    """One pre-norm Llama layer. window: its sliding window (Mistral); qkv_bias: q/k/v
    biases without an o_proj one (Qwen2; default: attention_bias on all four); qk_norm:
    per-head q/k norms (Qwen3); qkv, gate_up: the checkpoint's names (fused in Phi-3);
    mlp: another feed-forward block (a mixture of experts)."""
    bias = cfg.attention_bias
    attn = Attention(i, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     LayerAttention(scale=cfg.head_dim ** -0.5, window=window),
                     bias=bias if qkv_bias is None else qkv_bias, out_bias=bias, qkv=qkv,
                     qk_norm=qk_norm)
    if mlp is None:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                       gate_fn(cfg.hidden_act, cfg.source), gate_up,
                       bias=bool(cfg.get("mlp_bias", False)))
    return DecoderLayer(attn, mlp, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


def llama_stack(cfg: ModelConfig, max_positions: int, layers: list[DecoderLayer]) -> DecoderModel:
    """The decoder stack around ``layers``: one rotary table, RMSNorm at the end."""
    rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
    return DecoderModel(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), [rotary])


class LlamaForCausalLM(CausalLM):
    architecture = "llama"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        layers = [llama_layer(cfg, i) for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))
