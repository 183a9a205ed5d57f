"""Phi-3: the Llama layer over the checkpoint's fused ``qkv_proj`` and ``gate_up_proj``
tensors. The long-context variants' rotary (``longrope``) runs within the original
context (engine/layers/rotary.py says why not beyond); a partial rotary factor is
refused at start-up, naming the field."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.llama import llama_layer, llama_stack


class Phi3ForCausalLM(CausalLM):
    architecture = "phi3"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                          cfg.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise ValueError(f"{cfg.source}: partial_rotary_factor {partial} is not supported "
                             f"(Phi-3 with a rotary over the whole head only)")
        slides = cfg.sliding_window is not None
        layers = [llama_layer(cfg, i, window=cfg.layer_window(i, slides), qkv=("qkv_proj",),
                              gate_up=("gate_up_proj",)) for i in range(cfg.num_layers)]
        super().__init__(cfg, llama_stack(cfg, max_positions, layers))
