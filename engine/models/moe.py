"""Mixture-of-experts families: Mixtral (the Mistral layer with a sparse MoE block,
top-k weights renormalised) and Qwen3-MoE (the Qwen3 layer with one, renormalised
where ``norm_topk_prob`` says; dense layers where ``mlp_only_layers`` or
``decoder_sparse_step`` put them). Experts run as grouped matmuls (engine/layers/moe.py)."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.activation import gate_fn
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM
from engine.models.llama import llama_layer, llama_stack
from engine.models.qwen import sliding


class MixtralForCausalLM(CausalLM):
    architecture = "mixtral"
    renames = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        slides = cfg.sliding_window is not None
        layers = [llama_layer(cfg, i, window=cfg.layer_window(i, slides), mlp=SparseMoE(
                      cfg.hidden_size, cfg.intermediate_size, cfg.need("num_local_experts"),
                      cfg.need("num_experts_per_tok"), True,
                      gate_fn(cfg.hidden_act, cfg.source), ("w1", "w3", "w2")))
                  for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))


def _qwen3_moe_block(cfg: ModelConfig, i: int) -> SparseMoE | None:
    """Layer i's MoE block, or None where the layer is dense."""
    # transformers >= 5 writes num_local_experts, older configs num_experts (read first)
    older = cfg.get("num_experts") is not None or cfg.get("num_local_experts") is None
    experts = cfg.need("num_experts" if older else "num_local_experts")
    step = int(cfg.get("decoder_sparse_step", 1))
    if i in cfg.get("mlp_only_layers", []) or experts == 0 or (i + 1) % step:
        return None
    return SparseMoE(cfg.hidden_size, cfg.need("moe_intermediate_size"), experts,
                     cfg.need("num_experts_per_tok"), bool(cfg.get("norm_topk_prob", False)),
                     gate_fn(cfg.hidden_act, cfg.source))


class Qwen3MoeForCausalLM(CausalLM):
    architecture = "qwen3_moe"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        def norm(d: int) -> RMSNorm:
            return RMSNorm(d, cfg.rms_norm_eps)

        layers = [llama_layer(cfg, i, window=sliding(cfg, i), qk_norm=norm,
                              mlp=_qwen3_moe_block(cfg, i)) for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))
