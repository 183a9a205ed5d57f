"""Qwen2 / Qwen2.5 (the Llama layer with q/k/v biases) and Qwen3 (no biases, per-head
q/k RMSNorm before rotary). Both may slide on the layers from ``max_window_layers`` on
when ``use_sliding_window`` is set (config.json's layer_types, where present, says so)."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.norm import RMSNorm
from engine.models.base import CausalLM
from engine.models.llama import llama_layer, llama_stack


def sliding(cfg: ModelConfig, i: int) -> int | None:
    """Layer i's window: the layers from max_window_layers on slide, where any does."""
    slides = cfg.sliding_window is not None and i >= int(cfg.get("max_window_layers", 0))
    return cfg.layer_window(i, slides)


class Qwen2ForCausalLM(CausalLM):
    architecture = "qwen2"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        layers = [llama_layer(cfg, i, window=sliding(cfg, i), qkv_bias=True)
                  for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))


class Qwen3ForCausalLM(CausalLM):
    architecture = "qwen3"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        def norm(d: int) -> RMSNorm:
            return RMSNorm(d, cfg.rms_norm_eps)

        layers = [llama_layer(cfg, i, window=sliding(cfg, i), qk_norm=norm)
                  for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))
