"""Mistral: the Llama layer with a sliding window on every layer (``sliding_window``
in config.json; null means none, and it is then exactly Llama)."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.llama import llama_layer, llama_stack


class MistralForCausalLM(CausalLM):
    architecture = "mistral"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        slides = cfg.sliding_window is not None
        layers = [llama_layer(cfg, i, window=cfg.layer_window(i, slides))
                  for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))
